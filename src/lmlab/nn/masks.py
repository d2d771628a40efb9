"""Attention masks as pure functions.

Legend: T query tokens, S key tokens (cached + new). A mask is a bool tensor of shape (T, S) (or
broadcastable to (B, H, T, S)) in which **True means "may attend"**.
"""

from __future__ import annotations

import torch


def causal_mask(t: int, s: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, S) bool mask letting query i (absolute position S-T+i) see keys 0 .. S-T+i.

    With S == T this is the usual lower-triangular mask; with a cache of S-T earlier tokens the
    queries are the *last* T positions (bottom-right alignment). Raises ValueError if S < T.
    """
    if s < t:
        raise ValueError(f"causal mask needs at least as many keys as queries, got T={t}, S={s}")
    q = torch.arange(s - t, s, device=device).unsqueeze(1)
    k = torch.arange(s, device=device).unsqueeze(0)
    return k <= q
