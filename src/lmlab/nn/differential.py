"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv 2410.05258), in the
head layout of Hugging Face's DiffLlama.

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads (``n_heads``, the
query heads; H/2 differential heads), K kv heads, hd head_dim, r = H / K.

Each differential head subtracts a second softmax map from a first, to cancel the attention
noise both share (the paper's eq. 1-3)::

    DiffAttn(X) = (softmax(Q1 K1^T / sqrt(hd)) - lambda softmax(Q2 K2^T / sqrt(hd))) V
    lambda      = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init      (lq*, lk*: (hd,) learned)
    lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)),  l = 1..L the layer  (= lmlab's 0-based layer_idx)
    out_i       = (1 - lambda_init) RMSNorm(DiffAttn_i)              (per head, no weight)

``lambda`` is one scalar per layer (shared by its heads). Its init follows the paper's
``l - 1``: Hugging Face's ``lambda_init_fn(layer_idx)`` and the paper's reference code
``lambda_init_fn(depth)`` both pass the 0-based index, so the first layer has 0.2.

Head pairing (Hugging Face's DiffLlama, which this reproduces so its weights load by renaming):
the H query heads of ``q_proj`` and the K kv heads of ``k_proj``/``v_proj`` are Llama's; the
differential head i (0 <= i < H/2), with j = i // r, takes

- map 1 from query head i and key head j, map 2 from query head H/2 + i and key head K/2 + j;
- a value 2 hd wide: value heads j and K/2 + j side by side;
- channels [2 hd i, 2 hd (i+1)) of o_proj's input.

So the first half of the heads makes every first map, the second half every second map (K and
H even). The paper's reference code (microsoft/unilm, Diff-Transformer/multihead_diffattn.py)
pairs ADJACENT heads instead: q_proj's output viewed as 2 H' heads of hd (H' = H/2 its
``num_heads``), maps 2i and 2i+1, its v_proj's output viewed as K/2 heads of 2 hd contiguous
channels, its sub-layer norm with a learned weight (``elementwise_affine=True``) and interleaved
RoPE; reference-code weights need a row permutation of q/k/v (and that norm weight), not just
a rename. Hugging Face's RMSNorm has no weight; neither has this one.

The two maps are two calls of the attention core (:meth:`Attention.attend`) over the keys of
the one cached-keys step (:meth:`Attention.cached_keys`), so masks, padding, sliding windows,
GQA, backends, the ordinary KV cache of the full k and v and the StreamingLLM cache (``mask:
streaming``: both maps see the same sinks + window) behave as in
:class:`~lmlab.nn.attention.SoftmaxAttention`. Attention dropout is refused, as Hugging Face
refuses it: the paper defines no dropout of the difference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, AttentionOutput, SoftmaxAttention
from lmlab.nn.hooks import HookPoint
from lmlab.nn.kv_cache import LayerCache, LayerKVCache, SlidingWindowKVCache

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.position import PositionEncoding


def lambda_init_fn(layer_idx: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx) for the 0-based ``layer_idx`` (the paper's
    0.8 - 0.6 exp(-0.3 (l - 1)) with l = layer_idx + 1): 0.2 in the first layer, -> 0.8."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def lambda_std_dev(cfg: ModelConfig) -> float:
    """``model.attention.lambda_std_dev``, this kind's own field (the declared 0.1 when unset)."""
    return float(getattr(cfg.attention, "lambda_std_dev", 0.1))  # a variant field: no schema


def _split_heads(bias: torch.Tensor | None, h: int) -> tuple[torch.Tensor | None, ...]:
    """A score bias broadcastable to (B, H, T, S) -> the part for each map's H/2 heads."""
    if bias is None or bias.dim() < 3 or bias.shape[-3] != h:
        return bias, bias  # None, or the same for every head
    return bias[..., : h // 2, :, :], bias[..., h // 2 :, :, :]


@ATTENTION.register("differential")
class DifferentialAttention(SoftmaxAttention):
    """Differential attention: (softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V, per-head RMSNorm,
    times 1 - lambda_init (Ye et al. 2024); Hugging Face DiffLlama's head pairing."""

    examples: tuple[dict, ...] = (
        {},
        {"attention": {"n_kv_heads": 2}},
        {"attention": {"backend": "math"}},
        {"attention": {"mask": "sliding_window", "window": 4}},
        {"attention": {"qk_norm": True}},
        {"position": {"kind": "alibi"}},
        {"attention": {"mask": "streaming", "window": 6, "sink_tokens": 2}},
    )
    fields = {"lambda_std_dev": (float, 0.1)}  # HF's lambda_std_dev: init std of lq*, lk*

    @staticmethod
    def check(m: ModelConfig) -> None:
        """H and K even (the two maps split the heads), no attention dropout, lambda_std_dev
        >= 0."""
        a = m.attention
        if a.n_heads % 2:
            raise ConfigError(
                f"model.attention.n_heads must be even for kind=differential (its first and "
                f"second halves make the two maps), got {a.n_heads}"
            )
        if m.n_kv_heads % 2:
            raise ConfigError(
                f"model.attention.n_kv_heads must be even for kind=differential (the two maps "
                f"split the kv heads; no multi-query attention), got {m.n_kv_heads}"
            )
        if a.dropout:
            raise ConfigError(
                "model.attention.dropout must be 0 for kind=differential (the paper defines no "
                f"dropout of the difference of two maps; Hugging Face refuses it), got {a.dropout}"
            )
        std = lambda_std_dev(m)
        if not (std >= 0 and math.isfinite(std)):
            raise ConfigError(f"model.attention.lambda_std_dev must be >= 0, got {std}")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.check(cfg)
        hd, std = self.head_dim, lambda_std_dev(cfg)
        self.lambda_init = lambda_init_fn(layer_idx)
        self.lambda_q1 = nn.Parameter(torch.empty(hd).normal_(0.0, std))  # (hd,)
        self.lambda_k1 = nn.Parameter(torch.empty(hd).normal_(0.0, std))
        self.lambda_q2 = nn.Parameter(torch.empty(hd).normal_(0.0, std))
        self.lambda_k2 = nn.Parameter(torch.empty(hd).normal_(0.0, std))
        self.eps = cfg.norm.eps  # the per-head RMSNorm's (Hugging Face: rms_norm_eps)
        # hook_scores / hook_pattern see the first maps (B, H/2, T, S); these the second
        self.hook_scores_2 = HookPoint()
        self.hook_pattern_2 = HookPoint()

    def lambda_full(self, dtype: torch.dtype) -> torch.Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a 0-dim tensor of ``dtype``
        (the dot products and exp in at least float32, as Hugging Face)."""
        f = torch.promote_types(dtype, torch.float32)
        l1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=f)).to(dtype)
        l2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=f)).to(dtype)
        return l1 - l2 + self.lambda_init

    def head_norm(self, y: torch.Tensor) -> torch.Tensor:
        """(1 - lambda_init) RMSNorm over each differential head's 2 hd channels (no weight),
        y (B, H/2, T, 2 hd) -> the same shape and dtype (computed in at least float32)."""
        yf = y.to(torch.promote_types(y.dtype, torch.float32))
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (1.0 - self.lambda_init) * yf.to(y.dtype)

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | SlidingWindowKVCache | None = None,
    ) -> AttentionOutput:
        """x (B, T, D) -> AttentionOutput(out (B, T, D)); arguments as
        :meth:`SoftmaxAttention.forward`. The first maps (B, H/2, T, S) go through
        ``hook_pattern``, the second through ``hook_pattern_2``."""
        h2, k2 = self.n_heads // 2, self.n_kv_heads // 2
        q, k, v = self.project(x, position, positions)  # (B, H, T, hd), (B, K, T, hd) x 2
        c = self.cached_keys(k, v, positions, key_mask, cache)
        k, v, mask_fn, key_mask = c.k, c.v, c.mask_fn, c.key_mask  # k, v (B, K, S, hd)
        v2 = torch.cat([v[:, :k2], v[:, k2:]], dim=-1)  # (B, K/2, S, 2 hd)
        b1, b2 = _split_heads(position.score_bias(positions, k.shape[2]), self.n_heads)
        y1, _ = self.attend(q[:, :h2], k[:, :k2], v2, mask_fn, key_mask, b1)
        second = (self.hook_scores_2, self.hook_pattern_2)  # the second map's hook points
        y2, _ = self.attend(q[:, h2:], k[:, k2:], v2, mask_fn, key_mask, b2, second)
        y = self.head_norm(y1 - self.lambda_full(q.dtype) * y2)  # (B, H/2, T, 2 hd)
        return AttentionOutput(self.merge_heads(y))  # (H/2, 2 hd) merge as (H, hd)

    def map_points(self, cache: LayerCache | None) -> tuple[HookPoint, ...]:
        """Both maps' pattern points: ``hook_pattern`` and ``hook_pattern_2``."""
        return (self.hook_pattern, self.hook_pattern_2)

    def attention_map(self, recorded: list[torch.Tensor]) -> torch.Tensor:
        """The two maps (B, H/2, T, S) -> (B, H, T, S), each query head's softmax map as
        Hugging Face returns them: heads [0, H/2) the first maps, [H/2, H) the second."""
        return torch.cat(recorded, dim=1)

    # ------------------------------------------------------------------ declared costs
    # The cache is SoftmaxAttention's (the full k and v): kv_cache_bytes and cached_tokens are
    # inherited.

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Elements per query token and layer autograd keeps for the two maps beyond what
        softmax attention keeps (:mod:`lmlab.training.memory`): SoftmaxAttention's scores (two
        maps of H/2 heads: 2 H T on ``math``, 0 on ``sdpa``), plus the paired values (K/2 heads
        of 2 hd: K hd) and the second map's output (H/2 heads of 2 hd: H hd; the first's is the
        attention output the estimate already counts)."""
        extra = (cfg.n_kv_heads + cfg.attention.n_heads) * cfg.head_dim
        return super().saved_score_elements(cfg, seq_len) + extra

    def saved_norm_elements(self) -> int:
        """The QK/V-norm outputs (as :class:`Attention`), plus the per-head RMSNorm's input,
        the difference (H hd), and its 1/rms (H/2)."""
        return super().saved_norm_elements() + self.n_heads * self.head_dim + self.n_heads // 2

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token and layer besides the weights: QK^T over H query heads of hd
        (2 S H hd) and each map times its 2 hd value (4 S H hd): 6 S H hd."""
        return 6 * seq_len * cfg.attention.n_heads * cfg.head_dim
