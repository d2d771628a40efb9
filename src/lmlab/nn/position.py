"""Positional encodings behind one interface with three hooks, each a no-op by default.

Legend: B batch, T query tokens, S key tokens, D d_model, H heads, K kv heads, hd head_dim.
``positions`` are int64 absolute positions, either (T,) shared by the batch or (B, T) per row
(a left-padded batch); the hooks accept both.

- :meth:`PositionEncoding.embed` adds to the token embeddings (sinusoidal, learned);
- :meth:`PositionEncoding.rotate` rotates q and k (RoPE);
- :meth:`PositionEncoding.score_bias` adds a (H, T, S) bias to the attention scores (ALiBi, T5).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.errors import LmlabError
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

POSITION: Registry[type[PositionEncoding]] = Registry("position", "model.position.kind")


class PositionEncoding(nn.Module):
    """Base class: every hook leaves its input unchanged."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_seq_len = cfg.max_seq_len

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), positions (T,) or (B, T) int64 -> (B, T, D)."""
        return x

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k (B, K, T, hd) at ``positions`` (T,) or (B, T) -> rotated (q, k)."""
        return q, k

    def score_bias(self, positions: torch.Tensor, s: int) -> torch.Tensor | None:
        """Additive (H, T, S) score bias for queries at ``positions`` over keys 0..S-1, or None."""
        return None


@POSITION.register("none")
class NoPosition(PositionEncoding):
    """No positional information (NoPE): causal attention still infers order (Haviv et al. 2022)."""


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(T,) or (B, T) positions -> (T, dim) or (B, T, dim) float32: sin on even, cos on odd
    channels (Vaswani et al. 2017).

    Channel pair i uses frequency 1 / 10000^(2i/dim).
    """
    half = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = torch.exp(-math.log(10000.0) * half / dim)
    angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, dim/2)
    table = torch.zeros(*positions.shape, dim, device=positions.device)
    table[..., 0::2] = torch.sin(angles)
    table[..., 1::2] = torch.cos(angles[..., : dim // 2])
    return table


@POSITION.register("sinusoidal")
class SinusoidalPosition(PositionEncoding):
    """Fixed sine/cosine table added to the embeddings (Vaswani et al. 2017)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.d_model = cfg.d_model

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + sinusoidal_table(positions, self.d_model).to(x.dtype)


@POSITION.register("learned")
class LearnedPosition(PositionEncoding):
    """A trained (max_seq_len, D) table added to the embeddings (GPT-2, Radford et al. 2019)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.weight = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.init_std)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Raises LmlabError if a position is >= max_seq_len (the table has no row for it)."""
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise LmlabError(
                f"position {int(positions.max())} is past model.max_seq_len={self.max_seq_len}: "
                "learned positions have no embedding there"
            )
        return x + self.weight[positions].to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """(hd/2,) float32 rotation frequencies theta^(-2i/hd) (Su et al. 2021, RoFormer)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim: the half-split ("GPT-NeoX / Llama") RoPE layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, hd) by angles given as cos/sin (T, hd) in the half-split layout."""
    return x * cos + rotate_half(x) * sin


@POSITION.register("rope")
class RotaryPosition(PositionEncoding):
    """Rotary position embedding: rotates each (i, i + hd/2) channel pair of q and k by
    position * theta^(-2i/hd), so q_m . k_n depends on m - n only (Su et al. 2021)."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.head_dim = cfg.head_dim
        self.register_buffer(
            "inv_freq", rope_inv_freq(self.head_dim, cfg.position.rope_theta), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) or (B, T) positions -> cos, sin each (T, hd) or (B, T, hd) float32 (any
        position, no table limit)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # (..., T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, hd)
        return emb.cos(), emb.sin()

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (T, hd) or (B, T, hd)
        if cos.dim() == 3:  # per-row positions: broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
