"""Attention masks as pure functions.

Legend: B batch, H heads, T query tokens, S key tokens (cached + new). A mask is a bool tensor of
shape (T, S) (or broadcastable to (B, H, T, S)) in which **True means "may attend"**.

The queries are always the *last* T of the S key positions (bottom-right alignment), so the same
function serves a full forward pass (S == T) and cached decoding (S - T earlier tokens). Each
registered mask has the signature ``fn(t, s, device=None, window=None) -> (T, S) bool``; the model
asks :data:`MASKS` for ``model.attention.mask`` once.

Padding is a separate, per-row key mask (B, S) (1 = real token, 0 = padding, the Hugging Face
``attention_mask``), combined with the structural mask by :func:`combine_masks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmlab.errors import ConfigError
from lmlab.registry import Registry

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

MaskFn = Callable[..., torch.Tensor]
MASKS: Registry[MaskFn] = Registry("mask", "model.attention.mask")
MASKS.notes = """
Selected by `model.attention.mask` (default `causal`). When to use: `causal` (a query sees
itself and every earlier token) for every decoder LM (Vaswani et al. 2017); `bidirectional` for
encoders, and to show why a decoder needs the causal mask; `sliding_window` (+
`model.attention.window`, required with it) for long generation with bounded memory: a query
sees itself and the window-1 tokens before it, and the KV cache keeps only the window.
"""


def _query_key_positions(
    t: int, s: int, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 1) query and (1, S) key indices, queries being the last T of S positions."""
    if s < t:
        raise ValueError(f"a mask needs at least as many keys as queries, got T={t}, S={s}")
    q = torch.arange(s - t, s, device=device).unsqueeze(1)
    k = torch.arange(s, device=device).unsqueeze(0)
    return q, k


@MASKS.register("causal")
def causal_mask(
    t: int, s: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Causal (autoregressive) attention: query i (position S-T+i) sees keys 0 .. S-T+i
    (Vaswani et al. 2017, decoder self-attention).

    Returns a (T, S) bool mask; with S == T the usual lower triangle. ``window`` is ignored.
    Raises ValueError if S < T.
    """
    q, k = _query_key_positions(t, s, device)
    return k <= q


@MASKS.register("bidirectional")
def bidirectional_mask(
    t: int, s: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Bidirectional attention: every query sees every key (BERT, Devlin et al. 2019).

    Returns an all-True (T, S) bool mask. In a decoder LM it lets a token see the future, so the
    next-token loss can be solved by copying: useful only to show why the causal mask exists.
    Raises ValueError if S < T.
    """
    _query_key_positions(t, s, device)
    return torch.ones(t, s, dtype=torch.bool, device=device)


def check_window(m: ModelConfig) -> None:
    """sliding_window reads ``model.attention.window``: set, in [1, model.max_seq_len]."""
    window = m.attention.window
    if window is None:
        raise ConfigError(
            "model.attention.window must be set for model.attention.mask=sliding_window "
            "(tokens a query sees, itself included; an integer in [1, model.max_seq_len])"
        )
    if not 1 <= window <= m.max_seq_len:
        raise ConfigError(
            f"model.attention.window must be in [1, model.max_seq_len={m.max_seq_len}], got "
            f"{window} (a window wider than the context is causal attention: use mask=causal)"
        )


@MASKS.register(
    "sliding_window",
    options=("window",),
    check=check_window,
    examples=({"attention": {"window": 4}}, {"attention": {"window": 1, "backend": "math"}}),
)
def sliding_window_mask(
    t: int, s: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Sliding-window causal attention: a query sees itself and the ``window - 1`` tokens before it
    (Beltagy et al. 2020, Longformer; Jiang et al. 2023, Mistral; the Hugging Face convention
    ``q - window < k <= q``).

    Returns a (T, S) bool mask. Raises ValueError if ``window`` is None or < 1, or S < T.
    """
    if window is None or window < 1:
        raise ValueError(f"a sliding-window mask needs window >= 1, got {window}")
    q, k = _query_key_positions(t, s, device)
    return (k <= q) & (k > q - window)


def combine_masks(
    structure: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine a structural (T, S) mask with a key padding mask (B, S) bool (True = real token).

    Returns (mask, empty_rows): mask (B, 1, T, S) bool (or the unchanged (T, S) mask when
    ``key_mask`` is None) and empty_rows (B, 1, T, 1) bool marking the queries that may attend to
    no key at all (or None). Those rows are opened fully in ``mask`` so that no kernel sees a
    row of -inf (which gives NaN); the caller zeroes their outputs with ``empty_rows``.
    """
    if key_mask is None:
        return structure, None
    mask = structure & key_mask[:, None, None, :]  # (B, 1, T, S)
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    return mask | empty, empty


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) attention mask (1 = real token, 0 = padding) -> (B, S) int64 positions counting
    real tokens only: 0 for the first real token of each row, padding positions set to 0.

    This is what Hugging Face ``generate`` does for a left-padded batch, so each row sees the
    positions it would see alone.
    """
    m = attention_mask.long()
    return ((m.cumsum(-1) - 1) * m).clamp_min(0)
