"""Guards of the training loop: non-finite losses and gradients, and stop signals.

NaN/Inf guard: after the backward pass the global gradient norm is computed once (the number
gradient clipping needs anyway); a non-finite norm means some gradient is non-finite, and only then
are the parameters scanned, in ``model.named_parameters()`` order, for the first one whose
gradient holds a NaN or an Inf. The trainer then skips the optimizer step (gradients zeroed, the
data position moves on) up to ``train.max_skipped_steps`` consecutive times.

Stop signals: during training SIGTERM raises :class:`Terminated` in the main thread, so the loop
checkpoints and exits exactly as it does for Ctrl-C (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn


def clip_gradients(model: nn.Module, max_norm: float) -> tuple[float, str | None]:
    """Clip the global L2 gradient norm to ``max_norm`` (0 = no clipping) unless it is non-finite.

    Returns (the norm before clipping, the name of the first parameter with a non-finite gradient
    or None). Non-finite gradients are left as they are (the caller skips the step). With finite
    gradients this is exactly ``torch.nn.utils.clip_grad_norm_`` (same operations, same bits).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0, None
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = float(total)
    if not math.isfinite(norm):
        return norm, first_nonfinite_grad(model)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return norm, None


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """Name of the first parameter (``named_parameters`` order) whose gradient has a NaN/Inf."""
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def first_nonfinite_param(model: nn.Module) -> str | None:
    """Name of the first parameter whose value holds a NaN or an Inf (weights already broken)."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p.detach()).all()):
            return name
    return None


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler :func:`sigterm_raises` installs.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` never swallows it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def sigterm_raises() -> Callable[[], None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread; returns the function that
    restores the previous handler. A no-op outside the main thread (Python only lets the main
    thread set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.signal(signal.SIGTERM, _raise_terminated)

    def restore() -> None:
        signal.signal(signal.SIGTERM, old)

    return restore


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while active (main thread only): a second Ctrl-C or SIGTERM
    must not interrupt the final checkpoint. The previous handlers are restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
