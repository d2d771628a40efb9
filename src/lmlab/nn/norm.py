"""Normalisation layers. Legend: D d_model; (..., D) in, the same shape and dtype out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

NORM: Registry[type[nn.Module]] = Registry("norm", "model.norm.kind")
NORM.notes = """
When to use: `layernorm` for GPT-2, NeoX and BERT; `rmsnorm` (computed in float32) for
Llama-family models, slightly cheaper.
"""


@NORM.register("layernorm")
class LayerNorm(nn.LayerNorm):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (Ba et al. 2016)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.d_model, eps=cfg.norm.eps, bias=cfg.norm.bias)


@NORM.register("rmsnorm")
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in at least float32 (Zhang & Sennrich 2019)."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None) -> None:
        super().__init__()
        self.eps = cfg.norm.eps
        self.weight = nn.Parameter(torch.ones(dim or cfg.d_model))  # dim: e.g. head_dim (QK-norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
        if x.dtype == dtype and self.weight.dtype == dtype:  # no casts to make (a decode step
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # runs 61 norms)
            return y * self.weight
        xf = x.to(dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dtype)).to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm named by ``cfg.norm.kind``."""
    return NORM.get(cfg.norm.kind, "model.norm.kind")(cfg)
