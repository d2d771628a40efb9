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
``model.attention.backend`` says; ``hook_pattern`` (and ``need_weights``) sees them. The KV cache is
:class:`~lmlab.nn.attention.SoftmaxAttention`'s (dynamic, bounded by a sliding window, or the
StreamingLLM cache of ``mask: streaming``: its forward is softmax attention's, so it streams;
an evicted key weighs 0 as a masked one does, and b stays -log(max_seq_len)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, SoftmaxAttention
from lmlab.nn.attention_core import AttentionFn, attend, backend_traits
from lmlab.nn.masks import MaskFn

if TYPE_CHECKING:
    from lmlab.config import ModelConfig


def sigmoid_bias(cfg: ModelConfig) -> float:
    """The score offset b: ``model.attention.sigmoid_bias``, or -log(model.max_seq_len)."""
    b = cfg.attention.sigmoid_bias  # type: ignore[attr-defined]
    return -math.log(cfg.max_seq_len) if b is None else float(b)


def sigmoid_backend(offset: float) -> AttentionFn:
    """The attention backend of sigmoid attention with score offset ``offset`` (b), for
    :func:`lmlab.nn.attention_core.attend` (which builds the masks, repeats kv heads and zeroes
    queries with no visible key): ``fn(q, k, v, mask, scale, dropout_p, bias=None)`` with q, k, v
    (B, H, T|S, hd), mask bool broadcastable to (B, H, T, S) or None, returning (out (B, H, T,
    hd), weights (B, H, T, S)), w = sigmoid(q k^T * scale + offset + bias) where the mask allows,
    else exactly 0. The sigmoid runs in the scores' dtype promoted to at least float32."""

    def sigmoid_math(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        dropout_p: float = 0.0,
        bias: torch.Tensor | None = None,
        scores_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale + offset  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if scores_hook is not None:  # the hook point layers.{i}.attn.hook_scores
            scores = scores_hook(scores)
        w = torch.sigmoid(scores).to(q.dtype)
        return torch.matmul(F.dropout(w, p=dropout_p) if dropout_p > 0.0 else w, v), w

    fn = backend_traits(sigmoid_math, returns_weights=True, takes_bias=True)
    fn.takes_scores_hook = True  # type: ignore[attr-defined]
    return fn


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
    """Sigmoid attention of q (B, H, T, hd) over k, v (B, K, S, hd), K = H / ``n_rep``: the
    attention core (:func:`lmlab.nn.attention_core.attend`, whose ``mask_fn``, ``window``,
    ``key_mask`` (B, S' >= S) bool True = real token, and ``bias`` it takes) with
    :func:`sigmoid_backend`. Returns (out (B, H, T, hd), weights (B, H, T, S)), both in q's
    dtype; a query with no visible key has weights 0 and outputs 0.
    """
    y, w = attend(
        q,
        k,
        v,
        backend=sigmoid_backend(offset),
        scale=scale,
        n_rep=n_rep,
        mask_fn=mask_fn,
        window=window,
        key_mask=key_mask,
        bias=bias,
        dropout_p=dropout_p,
    )
    assert w is not None  # the sigmoid backend always returns its weights
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
        {"attention": {"mask": "streaming", "window": 6, "sink_tokens": 2}},
    )

    @staticmethod
    def check(m: ModelConfig) -> None:
        """``sigmoid_bias``, when set, is a finite number."""
        b = m.attention.sigmoid_bias  # type: ignore[attr-defined]
        if b is not None and not math.isfinite(b):
            raise ConfigError(f"model.attention.sigmoid_bias must be a finite number, got {b}")

    sparse_mask_path = False  # no softmax: every score computed, the mask applied (dense)

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.offset = sigmoid_bias(cfg)  # b, added to every score
        # SoftmaxAttention.forward runs the attention core with this backend (whatever
        # model.attention.backend names: there is no fused sigmoid kernel)
        self.backend_fn = sigmoid_backend(self.offset)

    @classmethod
    def saved_score_elements(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Score elements per query token and layer autograd keeps: the weights, H T (the
        sigmoid's output, which its backward and the product with V both read)."""
        return cfg.attention.n_heads * seq_len
