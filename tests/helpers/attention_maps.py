"""An attention module's forward together with its attention map, recorded from its hook
points the way a model forward with ``need_weights=True`` records them
(:class:`lmlab.models.stack.LayerStack`), for tests that call one attention module directly."""

from __future__ import annotations

from typing import Any

import torch

from lmlab.nn.attention import Attention, AttentionOutput
from lmlab.nn.hooks import recording


def forward_with_map(
    attn: Attention, *args: Any, **kwargs: Any
) -> tuple[AttentionOutput, torch.Tensor]:
    """``attn(*args, **kwargs)`` and its map (B, H, T, S): what its ``map_points`` saw, joined
    by its ``attention_map``. Raises what ``map_points`` raises (nsa; linear over a cache)."""
    points = attn.map_points(kwargs.get("cache"))
    with recording(points) as seen:
        out = attn(*args, **kwargs)
    assert all(len(s) == 1 for s in seen), [len(s) for s in seen]
    return out, attn.attention_map([s[0] for s in seen])
