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


# Training under bf16 autocast on a CPU: a norm whose output only feeds matmuls (a pre-norm
# block's attention or MLP input) is computed by lmlab's C++ kernel straight to bfloat16 (what
# autocast's float32 norm and the matmul's cast give, without the float32 output:
# lmlab.nn.train_kernel.norm_bf16), at any size: through its C++ operator (torch.ops.lmlab.
# norm_bf16) it gains at nanoGPT's CPU shape too (768 x 128: step 1.04x, LayerNorm), where the
# Python autograd.Function it replaced cost what it saved (0.96-0.99x, hence a size gate then);
# the Mini-GPT shape 1.04-1.09x (LayerNorm), 1.29x (RMSNorm, five float32 ops in torch). False
# keeps torch's ops (A/B benchmarks).
TRAIN_NORM_KERNEL = True


def norm_for_matmuls(
    norm: nn.Module, x: torch.Tensor, consumer: nn.Module | None = None
) -> torch.Tensor:
    """``norm(x)`` for a caller whose only use of the result is as matmul input (under
    autocast, which casts it to bfloat16 there anyway): x (..., D) -> (..., D). While gradients
    are recorded under CPU bf16 autocast, for lmlab's LayerNorm (over the last dim) or
    RMSNorm with float32 parameters
    and no hooks, x float32, :data:`TRAIN_NORM_KERNEL` on, not under
    torch.compile and the kernel compiled, the result comes as bfloat16 from one C++ pass each
    way (:func:`lmlab.nn.train_kernel.norm_bf16`; its float32 values to float32 rounding of
    torch's, then the one rounding autocast makes). ``consumer``: the module that takes the
    result (softmax attention, an MLP); when it or a module inside it has a torch hook, its
    forward hooks would see bfloat16 where they see float32 without the kernel, so
    ``norm(x)`` (checked last: it walks the consumer's modules). Otherwise ``norm(x)``."""
    # the cheap checks first (a training step asks this twice a layer)
    kind = type(norm)
    if not TRAIN_NORM_KERNEL or (kind is not LayerNorm and kind is not RMSNorm):
        return norm(x)
    if x.dtype is not torch.float32 or not x.is_cpu or not torch.is_grad_enabled():
        return norm(x)
    if not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return norm(x)
    if torch.compiler.is_compiling():
        return norm(x)
    params = norm._parameters
    weight, bias = params.get("weight"), params.get("bias")
    d = x.shape[-1] if x.dim() else 0
    if kind is LayerNorm and tuple(norm.normalized_shape) != (d,):  # type: ignore[arg-type]
        return norm(x)
    if (
        weight is None
        or not _kernel_param(weight, d)
        or (bias is not None and not _kernel_param(bias, d))
    ):
        return norm(x)
    from lmlab.nn import train_kernel
    from lmlab.nn.fused import global_hooks, hooked_within, torch_hooks

    if torch_hooks(norm) or global_hooks():  # calling the norm would run more than its forward
        return norm(x)
    if consumer is not None and hooked_within(consumer):
        return norm(x)
    if not train_kernel.available():
        return norm(x)
    # norm_bf16's checks hold here (x float32 on the CPU, D >= 1, the parameters float32 (D,)
    # contiguous on the CPU): its operator directly
    eps = float(norm.eps)  # type: ignore[arg-type]
    return train_kernel.norm_bf16_op(x, weight, bias, eps, kind is RMSNorm)


def _kernel_param(p: torch.Tensor, d: int) -> bool:
    """A norm parameter the kernel reads: float32 (D,) contiguous on the CPU, D >= 1."""
    return (
        p.dtype is torch.float32
        and p.dim() == 1
        and p.shape[0] == d >= 1
        and p.is_cpu
        and p.is_contiguous()
    )


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm named by ``cfg.norm.kind``."""
    return NORM.get(cfg.norm.kind, "model.norm.kind")(cfg)
