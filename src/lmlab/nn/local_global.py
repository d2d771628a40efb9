"""Local + global attention: a sliding window plus global tokens (Longformer, Beltagy et al.
2020, sec. 3.1; BigBird, Zaheer et al. 2020, sec. 2 "global tokens" + "window").

Legend: B batch, T query tokens, S key tokens (cached + new). Masks are bool, True = may attend;
the queries are the last T of the S key positions, as every mask of :mod:`lmlab.nn.masks`.

Query at position p may attend to key at position j (causal: j <= p) when

- j is in p's window, ``p - j < window`` (bidirectional: ``|p - j| < window``), as
  ``sliding_window``; or
- j is global: every later query reads it (Longformer's "symmetric" global attention); or
- p is global: it reads every earlier key (bidirectional: every key).

A position is global when ``p < global_tokens`` (the first g tokens, BigBird-ITC's / Longformer's
[CLS]) or ``global_every > 0`` and ``p % global_every == 0`` (every k-th token, a strided set).
Positions count real tokens: with a key padding mask the first real token is position 0, as
:func:`~lmlab.nn.masks.position_ids_from_attention_mask` numbers a left-padded row, so a padded
row sees exactly what it sees alone.

The KV cache keeps every key (``keeps_all_keys``): a global key is read by all later queries.
Computation is dense, every T x S score then masked (the mask is the oracle of any sparse kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmlab.errors import ConfigError
from lmlab.nn.masks import MASKS, MaskFn, check_window, position_ids_from_attention_mask

if TYPE_CHECKING:
    from lmlab.config import ModelConfig


def local_global_allowed(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int,
    global_tokens: int = 1,
    global_every: int = 0,
    causal: bool = True,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule of the module docstring on broadcastable int64 positions: q_pos (..., T, 1),
    k_pos (..., 1, S) -> (..., T, S) bool, True = may attend. ``order``: the causal condition
    when not ``k_pos <= q_pos`` (on indices, for padded rows)."""

    def is_global(p: torch.Tensor) -> torch.Tensor:
        g = p < global_tokens
        return g | (p % global_every == 0) if global_every > 0 else g

    gap = q_pos - k_pos
    near = (gap < window) if causal else (gap.abs() < window)
    allowed = near | is_global(k_pos) | is_global(q_pos)
    if causal:
        allowed = allowed & ((k_pos <= q_pos) if order is None else order)
    return allowed


class LocalGlobalMask:
    """Local + global attention: a sliding window plus global tokens that see and are seen by
    every token (Beltagy et al. 2020, Longformer; Zaheer et al. 2020, BigBird).

    Called as every mask, ``mask(t, s, device=None, window=None) -> (T, S)`` bool over positions
    0 .. S-1 (the queries last), with this instance's ``global_tokens`` (first g positions are
    global, >= 0), ``global_every`` (every k-th position is global; 0: none) and ``causal``.
    ``from_config(cfg)`` is the instance for ``model.attention.global_tokens`` /
    ``global_every``; ``padded(key_mask)`` the mask function of one call over real-token
    positions. Raises ValueError for a ``window`` < 1 or None, or S < T.
    """

    keeps_all_keys = True  # the KV cache holds every key (see the module docstring)

    def __init__(self, global_tokens: int = 1, global_every: int = 0, causal: bool = True) -> None:
        self.global_tokens, self.global_every, self.causal = global_tokens, global_every, causal

    def __repr__(self) -> str:
        return f"LocalGlobalMask({self.global_tokens}, {self.global_every}, {self.causal})"

    def from_config(self, cfg: ModelConfig) -> LocalGlobalMask:
        """The mask of ``cfg.attention``'s global_tokens and global_every (causal)."""
        g, every = (getattr(cfg.attention, n) for n in ("global_tokens", "global_every"))
        return LocalGlobalMask(g, every, self.causal)

    def _rule(self, q: torch.Tensor, k: torch.Tensor, window: int | None, **kw) -> torch.Tensor:
        if window is None or window < 1:
            raise ValueError(f"a local_global mask needs window >= 1, got {window}")
        return local_global_allowed(
            q, k, window, self.global_tokens, self.global_every, self.causal, **kw
        )

    def __call__(
        self, t: int, s: int, device: torch.device | str | None = None, window: int | None = None
    ) -> torch.Tensor:
        if s < t:
            raise ValueError(f"a mask needs at least as many keys as queries, got T={t}, S={s}")
        q = torch.arange(s - t, s, device=device).unsqueeze(1)  # (T, 1)
        k = torch.arange(s, device=device).unsqueeze(0)  # (1, S)
        return self._rule(q, k, window)

    def padded(self, key_mask: torch.Tensor) -> MaskFn:
        """The mask function for key padding mask (B, S') bool, True = real token: positions
        count real tokens (its last S columns are the keys); returns (B, 1, T, S) bool."""

        def fn(
            t: int, s: int, device: torch.device | str | None = None, window: int | None = None
        ) -> torch.Tensor:
            pos = position_ids_from_attention_mask(key_mask[:, -s:].to(device))  # (B, S)
            q, k = pos[:, None, -t:, None], pos[:, None, None, :]  # (B, 1, T, 1), (B, 1, 1, S)
            idx = torch.arange(s, device=device)
            order = idx[None, :] <= idx[s - t :, None]  # (T, S) causal on indices
            return self._rule(q, k, window, order=order)

        return fn


def check_local_global(m: ModelConfig) -> None:
    """local_global reads ``window`` (as sliding_window), ``global_tokens`` >= 0 and
    ``global_every`` >= 0 (0: none)."""
    if m.attention.window is None:
        raise ConfigError(
            "model.attention.window must be set for model.attention.mask=local_global "
            "(tokens a query sees, itself included, besides the global ones)"
        )
    check_window(m)
    for name in ("global_tokens", "global_every"):
        value = getattr(m.attention, name)
        if not 0 <= value <= m.max_seq_len:
            raise ConfigError(
                f"model.attention.{name} must be in [0, model.max_seq_len={m.max_seq_len}], "
                f"got {value}"
            )


local_global_mask = MASKS.register(
    "local_global",
    options=("window",),
    check=check_local_global,
    fields={"global_tokens": (int, 1), "global_every": (int, 0)},
    examples=(
        {"attention": {"window": 3}},
        {"attention": {"window": 2, "global_tokens": 2, "global_every": 4}},
        {"attention": {"window": 3, "global_tokens": 0, "global_every": 5, "backend": "math"}},
    ),
)(LocalGlobalMask())
