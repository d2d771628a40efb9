"""Self-attention: ``softmax(Q K^T / sqrt(d_k)) V`` (Vaswani et al. 2017).

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, K kv heads,
hd head_dim. Masks are bool with True = may attend.

Two interchangeable backends compute the same function:
``sdpa`` calls :func:`torch.nn.functional.scaled_dot_product_attention` (fused, fast, no weights);
``math`` spells the formula out and can return the attention weights for visualisation.
Grouped-query attention (Ainslie et al. 2023) shares each of the K key/value heads among H/K
query heads; K == H is multi-head attention, K == 1 multi-query attention (Shazeer 2019).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.nn.kv_cache import LayerKVCache
from lmlab.nn.masks import causal_mask
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding

ATTENTION: Registry[type[nn.Module]] = Registry("attention", "model.attention.kind")

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention. q (B, H, T, hd), k and v (B, H, S, hd); mask bool (T, S) or
    broadcastable (True = may attend); bias: additive float scores broadcastable to (B, H, T, S).

    Returns (out (B, H, T, hd), weights (B, H, T, S), rows summing to 1). A row whose keys are all
    masked gets weights of 0 (and so an output of 0) instead of NaN.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v), weights


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> tuple[torch.Tensor, None]:
    """The same function through PyTorch's fused kernel; shapes as :func:`attention_math`.

    Returns (out, None): the fused kernel never materialises the weights.
    """
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    return out, None


ATTENTION_BACKENDS: dict[str, AttentionFn] = {"sdpa": attention_sdpa, "math": attention_math}


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, K, S, hd) -> (B, K * n_rep, S, hd): each kv head serves n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


@dataclass
class AttentionOutput:
    out: torch.Tensor  # (B, T, D)
    weights: torch.Tensor | None  # (B, H, T, S) when requested


@ATTENTION.register("softmax")
class SoftmaxAttention(nn.Module):
    """Scaled dot-product attention with separate q/k/v/o projections; MHA, GQA or MQA."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        a = cfg.attention
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.dropout = a.dropout
        self.backend = a.backend
        d, hd = cfg.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=a.bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=a.bias)
        self.o_proj.is_residual_proj = True  # type: ignore[assignment]

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        causal: bool = True,
        cache: LayerKVCache | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x (B, T, D) at absolute ``positions`` (T,) -> AttentionOutput(out (B, T, D), weights).

        ``cache`` (if given) holds the keys/values of earlier tokens and is extended in place.
        ``need_weights`` switches to the math backend for this call.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B,K,T,hd)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B,K,T,hd)
        q, k = position.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, K, S, hd)
        s = k.shape[2]
        rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # (B, H, S, hd)

        bias = position.score_bias(positions, s)  # (H, T, S) or None
        dropout_p = self.dropout if self.training else 0.0
        mask = causal_mask(t, s, x.device) if causal and t > 1 else None  # (T, S)
        w: torch.Tensor | None
        if need_weights or self.backend == "math":
            y, w = attention_math(q, k, v, mask, self.scale, dropout_p, bias)
        elif bias is None and mask is not None and s == t:
            y, w = attention_sdpa(q, k, v, None, self.scale, dropout_p, is_causal=True)
        else:
            if bias is not None:  # fold the bool mask into the additive bias
                bias = bias.to(q.dtype)
                mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            y, w = attention_sdpa(q, k, v, mask, self.scale, dropout_p)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*hd)
        return AttentionOutput(self.o_proj(y), w if need_weights else None)
