"""Sigmoid attention: ``sigmoid(Q K^T / sqrt(d_k) + b) V`` in place of the softmax (Ramapuram
et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention", arXiv
2409.04431, eq. 2 and sec. 3.4).

Legend: B batch, T query tokens, S key tokens (cache + T), D d_model, H heads, K kv heads,
hd head_dim. Masks are bool with True = may attend.

Each weight is the sigmoid of its own score, so a row need not sum to 1 and no row-wise
normalisation couples the keys. The paper's bias ``b = -log(n)``, n the sequence length, keeps
the initial row sum near 1 (their sec. 3.4, "n" the training sequence length). Here n is fixed
at ``model.max_seq_len`` (or ``b`` is set as ``model.attention.sigmoid_bias``), never the current
length: a score then does not change as the cache grows, so cached decoding == the full pass.

Masked and padding keys weigh exactly 0 (``sigmoid(-inf) = 0``), a query with no visible key
outputs 0, GQA shares each kv head among H/K query heads; score biases (ALiBi, T5) add to the
scores. The weights are always materialised (B, H, T, S) (there is no fused kernel), whatever
``model.attention.backend`` says; ``need_weights`` returns them. The KV cache is
:class:`~lmlab.nn.attention.SoftmaxAttention`'s (dynamic, or bounded by a sliding window).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, AttentionOutput, SoftmaxAttention, repeat_kv
from lmlab.nn.masks import MaskFn, combine_masks

if TYPE_CHECKING:
    from lmlab.config import ModelConfig
    from lmlab.nn.kv_cache import LayerKVCache, SlidingWindowKVCache
    from lmlab.nn.position import PositionEncoding


def sigmoid_bias(cfg: ModelConfig) -> float:
    """The score offset b: ``model.attention.sigmoid_bias``, or -log(model.max_seq_len)."""
    b = cfg.attention.sigmoid_bias  # type: ignore[attr-defined]
    return -math.log(cfg.max_seq_len) if b is None else float(b)


def sigmoid_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    offset: float,
    n_rep: int = 1,
    mask_fn: MaskFn | None = None,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid attention of q (B, H, T, hd) over k, v (B, K, S, hd), K = H / ``n_rep``.

    w = sigmoid(q k^T * scale + offset + bias) where the mask allows, else exactly 0; ``mask_fn``,
    ``window``, ``key_mask`` (B, S' >= S) bool True = real token, and ``bias`` (broadcastable to
    (B, H, T, S)) as :func:`lmlab.nn.attention_core.attend`. The sigmoid runs in the scores'
    dtype promoted to at least float32. Returns (out (B, H, T, hd), weights (B, H, T, S)),
    both in q's dtype; a query with no visible key has weights 0 and outputs 0.
    """
    t, s = q.shape[2], k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
    if key_mask is not None:
        key_mask = key_mask[:, -s:]  # a sliding cache keeps only the last keys
    structure = (
        mask_fn(t, s, q.device, window)
        if mask_fn is not None
        else torch.ones(t, s, dtype=torch.bool, device=q.device)
    )
    mask, empty = combine_masks(structure, key_mask)  # (T, S) or (B, 1, T, S)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + offset  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    w = torch.sigmoid(scores.to(dtype).masked_fill(~mask, float("-inf"))).to(q.dtype)
    if empty is not None:  # a query with no visible key (a padding row) outputs 0
        w = w.masked_fill(empty, 0.0)
    y = torch.matmul(F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w, v)  # (B, H, T, hd)
    return y, w


@ATTENTION.register("sigmoid")
class SigmoidAttention(SoftmaxAttention):
    """Sigmoid attention, w = sigmoid(q.k / sqrt(d_k) + b), b = -log(max_seq_len) by default
    (Ramapuram et al. 2024); MHA, GQA or MQA, any mask, ALiBi/T5 biases added to the scores."""

    # sigmoid_bias: the score offset b; None (unset) means -log(model.max_seq_len)
    fields: dict[str, tuple[Any, Any]] = {"sigmoid_bias": (Optional[float], None)}  # noqa: UP045
    examples: tuple[dict, ...] = (
        {},
        {"attention": {"n_kv_heads": 1}},
        {"attention": {"n_kv_heads": 2, "qk_norm": True, "sigmoid_bias": -1.5}},
        {"attention": {"mask": "sliding_window", "window": 4}},
        {"attention": {"mask": "local_global", "window": 3, "global_tokens": 2}},
        {"position": {"kind": "alibi"}},
    )

    @staticmethod
    def check(m: ModelConfig) -> None:
        """``sigmoid_bias``, when set, is a finite number."""
        b = m.attention.sigmoid_bias  # type: ignore[attr-defined]
        if b is not None and not math.isfinite(b):
            raise ConfigError(f"model.attention.sigmoid_bias must be a finite number, got {b}")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.offset = sigmoid_bias(cfg)  # b, added to every score

    def forward(
        self,
        x: torch.Tensor,
        position: PositionEncoding,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cache: LayerKVCache | SlidingWindowKVCache | None = None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x (B, T, D) at ``positions`` (T,) or (B, T) -> AttentionOutput(out (B, T, D), weights
        (B, H, T, S) or None); arguments as :meth:`SoftmaxAttention.forward`."""
        q, k, v = self.project(x, position, positions)  # (B, H, T, hd), (B, K, T, hd) x 2
        if cache is not None:
            k, v = cache.update(k, v)  # (B, K, S, hd)
        y, w = sigmoid_attend(
            q,
            k,
            v,
            scale=self.scale,
            offset=self.offset,
            n_rep=self.n_heads // self.n_kv_heads,
            mask_fn=self.structure(key_mask),
            window=self.window,
            key_mask=key_mask,
            bias=position.score_bias(positions, k.shape[2]),  # (H, T, S) or None
            dropout_p=self.dropout_p,
        )
        return AttentionOutput(self.merge_heads(y), w if need_weights else None)

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token and layer autograd keeps: the weights, H T (the
        sigmoid's output, which its backward and the product with V both read)."""
        return cfg.attention.n_heads * seq_len
