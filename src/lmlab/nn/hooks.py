"""Named hook points: an identity module placed on an activation, which calls the functions
registered on it (read, record or replace the activation) and costs one attribute check when
none are.

A :class:`HookPoint` has no parameters or buffers, so the state-dict keys of a model stay as
they were; its name is its module path (``layers.0.attn.hook_pattern``), set by
:func:`name_hook_points`. :mod:`lmlab.hooks` (``run_with_cache``, ``run_with_hooks``) is the
public way to use them. The design (named identity points on every activation) is
TransformerLens's HookPoint (Nanda & Bloom 2022); the code and the names are lmlab's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lmlab.errors import LmlabError

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]


class HookPoint(nn.Module):
    """Identity on a tensor; with functions registered, each is called in order as
    ``fn(tensor, name)`` and a returned tensor replaces the activation (None keeps it).

    ``__call__`` is overridden (no ``nn.Module`` call machinery, no torch forward hooks): an
    unhooked point returns its input after one list check."""

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.name = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fns:
            return x
        return self.run(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape) -> x, or what the registered functions return in its place."""
        return self(x)

    @property
    def active(self) -> bool:
        """Whether any function is registered (attention materialises its scores and pattern
        only when its score or pattern point is active, or weights are asked for)."""
        return bool(self.fns)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Call every registered function on x in order; each sees the previous one's result."""
        for fn in self.fns:
            y = fn(x, self.name)
            if y is not None:
                if not isinstance(y, torch.Tensor):
                    raise LmlabError(
                        f"hook on {self.name!r} returned {type(y).__name__}, not a tensor or None"
                    )
                if y.shape != x.shape:
                    raise LmlabError(
                        f"hook on {self.name!r} returned shape {tuple(y.shape)}, the activation "
                        f"is {tuple(x.shape)}"
                    )
                x = y
        return x

    def extra_repr(self) -> str:
        return f"{len(self.fns)} fn(s)" if self.fns else ""


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by its module path (its ``name`` set to that path), in
    forward order as the modules are declared."""
    points: dict[str, HookPoint] = {}
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = path
            points[path] = module
    return points


def fast_hook_lookup(model: nn.Module) -> None:
    """Name every hook point of ``model`` and make ``parent.hook_x`` a plain instance
    attribute as well as a child module: ``nn.Module.__getattr__`` (the path a submodule
    attribute takes) costs microseconds per call site, the instance dict tens of nanoseconds.
    Called once at the end of each model's ``__init__``; reassigning the attribute
    (``nn.Module.__setattr__``) drops the instance-dict copy, so the two never disagree."""
    name_hook_points(model)
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, HookPoint):
                object.__setattr__(parent, name, child)


@contextmanager
def recording(points: Sequence[HookPoint]) -> Iterator[list[list[torch.Tensor]]]:
    """Record what each of ``points`` sees during the ``with`` body: yields one list per point
    (in the order given) that fills with the tensors the point passes on, as the forward
    computed them (not detached, not copied). The recorder runs after any function already
    registered, so it sees what those returned; it replaces nothing, and it is removed on
    leaving, error or not. This is how a model's ``need_weights=True`` gets its attention maps
    (:class:`~lmlab.models.stack.LayerStack`)."""
    seen: list[list[torch.Tensor]] = [[] for _ in points]
    added: list[tuple[HookPoint, HookFn]] = []

    def recorder(into: list[torch.Tensor]) -> HookFn:
        def record(x: torch.Tensor, _: str) -> None:
            into.append(x)

        return record

    try:
        for point, into in zip(points, seen, strict=True):
            fn = recorder(into)
            point.fns.append(fn)
            added.append((point, fn))
        yield seen
    finally:
        for point, fn in added:
            point.fns.remove(fn)
