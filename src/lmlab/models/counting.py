"""Parameter counting of a built model, shared by every model family."""

from __future__ import annotations

from torch import nn


def num_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Distinct parameters of ``model`` (tied weights counted once); ``non_embedding`` leaves out
    the token embedding ``model.embed`` (and a head tied to it, which is the same matrix)."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if non_embedding:
        n -= model.embed.weight.numel()  # type: ignore[union-attr,operator]
    return n
