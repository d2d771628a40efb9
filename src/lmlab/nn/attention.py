"""Self-attention: ``softmax(Q K^T / sqrt(d_k)) V`` (Vaswani et al. 2017), and linear attention.

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, K kv heads,
hd head_dim. Masks are bool with True = may attend; which keys a query sees is the registered
mask ``model.attention.mask`` (causal, bidirectional, sliding_window; see :mod:`lmlab.nn.masks`),
intersected with the caller's key padding mask.

Two interchangeable backends compute the same function:
``sdpa`` calls :func:`torch.nn.functional.scaled_dot_product_attention` (fused, fast, no weights);
``math`` spells the formula out and can return the attention weights for visualisation.
Grouped-query attention (Ainslie et al. 2023) shares each of the K key/value heads among H/K
query heads; K == H is multi-head attention, K == 1 multi-query attention (Shazeer 2019).
Options on both kinds: ``qk_norm`` (RMSNorm of each q and k head), ``scaled`` (False drops the
1/sqrt(d_k) factor), attention ``dropout``, per-projection bias (``bias``, ``out_bias``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError, LmlabError
from lmlab.nn.kv_cache import LayerCache, LayerKVCache, LinearAttentionState, SlidingWindowKVCache
from lmlab.nn.masks import MASKS, causal_mask, combine_masks
from lmlab.nn.norm import RMSNorm
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
    masked gets weights of 0 (and so an output of 0) instead of NaN. The softmax runs in the
    scores' dtype promoted to at least float32 (bf16/fp16 up to float32, float64 stays float64),
    so a float64 model is a float64 reference.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # promote, never demote
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).nan_to_num(0.0).to(q.dtype)
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
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, None]:
    """The same function through PyTorch's fused kernel; shapes as :func:`attention_math`, except
    that with ``enable_gqa`` k and v may have K heads dividing H (torch >= 2.5).

    Returns (out, None): the fused kernel never materialises the weights.
    """
    gqa = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    )
    return out, None


# torch >= 2.5: scaled_dot_product_attention shares kv heads itself (no repeat_kv copy)
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)


ATTENTION_BACKENDS: dict[str, AttentionFn] = {"sdpa": attention_sdpa, "math": attention_math}


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, K, S, hd) -> (B, K * n_rep, S, hd): each kv head serves n_rep consecutive query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


@dataclass
class AttentionOutput:
    out: torch.Tensor  # (B, T, D)
    weights: torch.Tensor | None  # (B, H, T, S) when requested


class Attention(nn.Module):
    """What both attention kinds share: q/k/v/o projections, optional QK-norm, the mask.

    Subclasses implement ``forward(x, position, positions, key_mask=None, cache=None,
    need_weights=False) -> AttentionOutput`` and ``new_cache()`` (their per-layer decoding state).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        a = cfg.attention
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = a.dropout
        self.mask_fn = MASKS.get(a.mask, "model.attention.mask")
        self.window = a.window  # tokens a query sees (itself included); sliding_window only
        d, hd = cfg.d_model, self.head_dim
        out_bias = a.bias if a.out_bias is None else a.out_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=a.bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=out_bias)
        self.o_proj.is_residual_proj = True  # type: ignore[assignment]
        # QK-norm: RMSNorm over each head's hd channels of q and k, before RoPE (Dehghani et al.
        # 2023, ViT-22B; as in Qwen3). Bounds the logits q.k, which stabilises training.
        self.q_norm = RMSNorm(cfg, dim=hd) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg, dim=hd) if a.qk_norm else nn.Identity()
        # v_norm: the same on each v head; with qk_norm, HybridNorm's QKV-norm (Zhuo et al. 2025).
        self.v_norm = RMSNorm(cfg, dim=hd) if a.v_norm else nn.Identity()

    def project(
        self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> q (B, H, T, hd), k and v (B, K, T, hd), q and k normalised (QK-norm)
        and rotated to ``positions`` (T,) or (B, T)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        q, k = position.rotate(q, k, positions)  # q (B, H, T, hd), k (B, K, T, hd)
        return q, k, v

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, T, hd) -> o_proj of (B, T, H*hd) -> (B, T, D)."""
        b, _, t, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    # ------------------------------------------------------------------ declared costs
    # What a module cannot show by its weights, per layer, for a ModelConfig (read by
    # lmlab.analysis.costs; parameters and matmul FLOPs are counted from the module itself).
    # Every kind here computes QK^T and AV and caches a key and a value per token unless it
    # says otherwise; a kind also declares kv_cache_bytes (and cached_tokens) for its cache.

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds to this layer's cache: its key and value, 2 K hd dtype_bytes
        (with a sliding window, until the cache holds the window)."""
        return 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes

    @classmethod
    def score_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """FLOPs per query token and layer besides the weights: QK^T and AV against ``seq_len``
        keys, 4 T H hd (2 per multiply-add; PaLM, Chowdhery et al. 2022, app. B). Every T x T
        score is computed and then masked, so the mask does not change it (linear attention's
        parallel form: phi(Q) phi(K)^T and its product with V, the same count)."""
        return 4 * seq_len * cfg.attention.n_heads * cfg.head_dim


@ATTENTION.register("softmax")
class SoftmaxAttention(Attention):
    """Scaled dot-product attention with separate q/k/v/o projections; MHA, GQA or MQA."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.attention.scaled else 1.0
        self.backend = cfg.attention.backend

    def new_cache(self) -> LayerKVCache | SlidingWindowKVCache:
        """A dynamic cache, or a bounded one when a sliding window limits what a query sees."""
        return LayerKVCache() if self.window is None else SlidingWindowKVCache(self.window)

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | SlidingWindowKVCache | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x (B, T, D) at absolute ``positions`` (T,) or (B, T) -> AttentionOutput(out (B, T, D),
        weights (B, H, T, S) or None).

        ``key_mask`` (B, S_total) bool, True = real token, covers every token seen so far
        (cached + new); padding keys are never attended to, and a query with no key to attend to
        outputs 0. ``cache`` (if given) holds the keys/values of earlier tokens and is extended in
        place. ``need_weights`` switches to the math backend for this call.
        """
        t = x.shape[1]
        q, k, v = self.project(x, position, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, K, S, hd)
        s = k.shape[2]
        rep = self.n_heads // self.n_kv_heads
        bias = position.score_bias(positions, s)  # (H, T, S) or None
        dropout_p = self.dropout if self.training else 0.0
        plain_causal = bias is None and key_mask is None and self.mask_fn is causal_mask
        fused = not need_weights and self.backend == "sdpa"
        if fused and plain_causal and (s == t or t == 1):  # no mask to build: the fast path
            # s == t: causal over the new tokens; t == 1: one new token sees every cached key
            gqa = SDPA_GQA and rep > 1
            if not gqa:
                k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # (B, H, S, hd)
            y, _ = attention_sdpa(q, k, v, None, self.scale, dropout_p, s == t, enable_gqa=gqa)
            return AttentionOutput(self.merge_heads(y), None)
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # (B, H, S, hd)
        if key_mask is not None:
            key_mask = key_mask[:, -s:]  # a sliding cache keeps only the last keys
        mask, empty = combine_masks(self.mask_fn(t, s, x.device, self.window), key_mask)
        w: torch.Tensor | None
        if need_weights or self.backend == "math":
            y, w = attention_math(q, k, v, mask, self.scale, dropout_p, bias)
        else:
            if bias is not None:  # fold the bool mask into the additive bias
                bias = bias.to(q.dtype)
                mask = bias.masked_fill(~mask, float("-inf"))
            y, w = attention_sdpa(q, k, v, mask, self.scale, dropout_p)
        if empty is not None:  # queries with no visible key (padding rows) output 0
            y = y.masked_fill(empty, 0.0)
            w = None if w is None else w.masked_fill(empty, 0.0)
        return AttentionOutput(self.merge_heads(y), w if need_weights else None)

    # ------------------------------------------------------------------ declared costs
    # What the module cannot show by its weights: per layer, for a ModelConfig (see
    # lmlab.analysis.costs). Parameters and matmul FLOPs are counted from the module itself.

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens the cache holds while decoding token ``context``: all of them, or at most
        ``window`` with a sliding window (window - 1 kept between steps + the new one)."""
        window = cfg.attention.window if cfg.attention.mask == "sliding_window" else None
        return context if window is None else min(context, window)

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """Bytes this layer's cache holds for ``batch`` sequences while decoding token
        ``context``: batch * :meth:`cached_tokens` * :meth:`kv_cache_bytes_per_token` (the
        dynamic cache, or the sliding-window one bounded at ``window`` tokens)."""
        return (
            batch * cls.cached_tokens(cfg, context) * cls.kv_cache_bytes_per_token(cfg, dtype_bytes)
        )

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token and layer that autograd keeps for backward: the
        scores and probabilities, 2 H T, on the ``math`` backend; 0 for ``sdpa`` (its fused
        kernels keep one log-sum-exp per row). See :mod:`lmlab.training.memory`."""
        return 2 * cfg.attention.n_heads * seq_len if cfg.attention.backend == "math" else 0


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al. 2020 (their eq. 7)."""
    return F.elu(x) + 1.0


@ATTENTION.register("linear")
class LinearAttention(Attention):
    """Linear attention: sim(q, k) = phi(q) . phi(k) with phi = elu + 1, so causal attention is an
    RNN whose state is sum phi(k) v^T (Katharopoulos et al. 2020, "Transformers are RNNs").

    Output i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the keys j it sees
    (no softmax, no 1/sqrt(d_k)). Training uses the parallel (masked, T x S) form, which also
    gives the normalised weights; cached decoding uses the recurrent form with a constant-size
    :class:`LinearAttentionState`. Masks: causal or bidirectional (a sliding window has no
    constant-size state). Score biases (ALiBi) cannot apply and raise LmlabError.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.attention.mask not in ("causal", "bidirectional"):
            raise ConfigError(
                f"model.attention.kind=linear supports model.attention.mask causal or "
                f"bidirectional, got {cfg.attention.mask!r}"
            )

    def new_cache(self) -> LinearAttentionState:
        """The recurrent state (sum phi(k) v^T, sum phi(k)), empty."""
        return LinearAttentionState()

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x (B, T, D) -> AttentionOutput(out (B, T, D), weights (B, H, T, T) or None).

        Arguments as :meth:`SoftmaxAttention.forward`; ``cache`` must be a
        :class:`LinearAttentionState` (TypeError otherwise). ``need_weights`` with earlier tokens
        in the cache raises LmlabError: the state keeps no per-key information.
        """
        t = x.shape[1]
        if cache is not None and not isinstance(cache, LinearAttentionState):
            raise TypeError(f"linear attention needs a LinearAttentionState, got {type(cache)}")
        past = cache if cache is not None and cache.seq_len > 0 else None
        if need_weights and past is not None:
            raise LmlabError(
                "linear attention cannot return weights over cached tokens (its state keeps no "
                "per-key information); ask for weights on a forward pass without a cache"
            )
        q, k, v = self.project(x, position, positions)
        if position.score_bias(positions, t + (past.seq_len if past else 0)) is not None:
            raise LmlabError("linear attention has no scores to add a position bias (ALiBi) to")
        fq, fk = elu_feature_map(q), elu_feature_map(k)  # (B, H, T, hd), (B, K, T, hd)
        if key_mask is not None:  # padding keys contribute nothing, now or to the state
            fk = fk * key_mask[:, -t:, None].to(fk.dtype)[:, None]
        rep = self.n_heads // self.n_kv_heads

        # Parallel form over the new tokens: sim (B, H, T, T), zero where the mask forbids.
        sim = torch.matmul(fq, repeat_kv(fk, rep).transpose(-2, -1))
        sim = sim.masked_fill(~self.mask_fn(t, t, x.device), 0.0)
        den = sim.sum(-1, keepdim=True)  # (B, H, T, 1)
        past_num = None
        if past is not None:  # recurrent form: the state sums over every earlier token
            assert past.state is not None and past.normalizer is not None
            past_num = torch.matmul(fq, repeat_kv(past.state, rep))  # (B, H, T, hd)
            den = den + torch.matmul(fq, repeat_kv(past.normalizer, rep).unsqueeze(-1))
        den = den.clamp_min(torch.finfo(den.dtype).tiny)  # no visible key: 0 / tiny = 0
        w = sim / den  # (B, H, T, T) normalised weights over the new tokens
        dropout_p = self.dropout if self.training else 0.0
        y = torch.matmul(F.dropout(w, p=dropout_p) if dropout_p else w, repeat_kv(v, rep))
        if past_num is not None:
            y = y + past_num / den
        if cache is not None:
            cache.update(fk, v)
        return AttentionOutput(self.merge_heads(y), w if need_weights else None)

    # ------------------------------------------------------------------ declared costs

    @classmethod
    def cached_tokens(cls, cfg: ModelConfig, context: int) -> int:
        """Tokens held: none, the recurrent state keeps no per-token keys or values."""
        return 0

    @classmethod
    def kv_cache_bytes_per_token(cls, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """Bytes one token adds: 0, the state has a constant size."""
        return 0

    @classmethod
    def kv_cache_bytes(
        cls, cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 4
    ) -> int:
        """Bytes of this layer's recurrent state for ``batch`` sequences, whatever ``context``:
        sum phi(k) v^T and sum phi(k), K (hd hd + hd) numbers per sequence (Katharopoulos et
        al. 2020, eq. 10-12)."""
        hd = cfg.head_dim
        return batch * cfg.n_kv_heads * (hd * hd + hd) * dtype_bytes

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """0: the memory estimate counts no score tensors for linear attention."""
        return 0
