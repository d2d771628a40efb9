"""Guards of the training loop: non-finite losses and gradients, and stop signals.

NaN/Inf guard: after the backward pass the global gradient norm is computed once (the number
gradient clipping needs anyway); a non-finite norm means some gradient is non-finite, and only then
are the parameters scanned, in ``model.named_parameters()`` order, for the first one whose
gradient holds a NaN or an Inf. The trainer then skips the optimizer step (gradients zeroed, the
data position moves on) up to ``train.max_skipped_steps`` consecutive times.

Stop signals: during training SIGINT (Ctrl-C) and SIGTERM are recorded by :class:`StopSignals`
and acted on at the top of the next step: the loop checkpoints the last whole step and exits with
the command that resumes.
"""

from __future__ import annotations

import math
import signal
import threading
from typing import Any

import torch
from torch import nn


def clip_gradients(
    model: nn.Module, max_norm: float, params: list[nn.Parameter] | None = None
) -> tuple[float, str | None]:
    """Clip the global L2 gradient norm to ``max_norm`` (0 = no clipping) unless it is non-finite.

    Returns (the norm before clipping, the name of the first parameter with a non-finite gradient
    or None). Non-finite gradients are left as they are (the caller skips the step). ``params``:
    the model's parameters when the caller keeps the list (``model.parameters()`` otherwise).

    Plain contiguous float32 CPU gradients with lmlab's C++ kernels compiled: one C++ call
    (:func:`lmlab.nn.train_kernel.clip_grads_`, which checks the tensors itself): the norm from
    a float64 sum of squares (torch's per-tensor float32 norms agree to a few float32 roundings:
    the coefficient may differ by a few ulps; a sum of squares past float32's range is an inf
    norm, as torch's is), the coefficient ``min(max_norm / (norm + 1e-6), 1)`` computed in
    float32 as torch computes it, and a scaling pass only when it is below 1 (torch multiplies
    by 1 too). Otherwise (CUDA, DTensor shards, bf16 gradients, no kernels, torch.compile or a
    torch dispatch mode, :data:`CLIP_KERNEL` off) exactly ``torch.nn.utils.clip_grad_norm_``
    (same operations, same bits).
    """
    source = model.parameters() if params is None else params
    with_grad = [p for p in source if p.grad is not None]
    grads = [p.grad for p in with_grad if p.grad is not None]
    if not grads:
        return 0.0, None
    clipped = _clip_kernel(grads, max_norm)
    if clipped is not None:
        norm = clipped[0]
        return (norm, None) if math.isfinite(norm) else (norm, first_nonfinite_grad(model))
    # plain CPU tensors: torch's foreach kernels (one call, the same per-tensor norms and the
    # same products, so the same bits) instead of its per-tensor default there; elsewhere
    # (CUDA, DTensor shards) torch's own choice
    cpu = all(type(g) is torch.Tensor and g.device.type == "cpu" for g in grads)
    foreach = True if cpu else None
    total = torch.nn.utils.get_total_norm(grads, foreach=foreach)
    full = getattr(total, "full_tensor", None)  # FSDP2: a DTensor reduced over the shards
    norm = float(full() if callable(full) else total)
    if not math.isfinite(norm):
        return norm, first_nonfinite_grad(model)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=foreach)
    return norm, None


CLIP_KERNEL = True
"""Whether :func:`clip_gradients` may use lmlab's C++ norm and scaling kernels (an A/B switch
for benchmarks and tests; off: torch's foreach ops)."""


def _clip_kernel(grads: list[torch.Tensor], max_norm: float) -> tuple[float, float] | None:
    """lmlab's one-call clipping of ``grads`` (norm, coefficient), or None with nothing
    written where it does not apply: :data:`CLIP_KERNEL` off, under torch.compile or a torch
    dispatch mode (:func:`lmlab.nn.train_kernel.traced`: a tracer would fix the operator's answer
    while the call still scales at run time, or see none of its work), a tensor subclass among
    them (DTensor shards: their own dispatch), CUDA or bf16 gradients, no kernels, or tensors
    the C++ operator refuses (:func:`lmlab.nn.train_kernel.clip_grads_`).
    The kernels are not built for a step they could not take: until they are, the operator's
    own checks are made here first."""
    from lmlab.nn import train_kernel

    if not CLIP_KERNEL or train_kernel.traced():
        return None
    f32, plain = torch.float32, torch.Tensor
    if not all(type(g) is plain and g.is_cpu and g.dtype is f32 for g in grads):
        return None
    if not train_kernel.loaded() and not _clip_could_take(grads):
        return None
    if not train_kernel.available():
        return None
    return train_kernel.clip_grads_(grads, max_norm)


def _clip_could_take(grads: list[torch.Tensor]) -> bool:
    """The C++ operator's checks of ``grads`` in Python (plain float32 CPU tensors known):
    contiguous, real and own memory, not recording gradients in grad mode, not inference
    tensors. Made only before the kernels are first built (then the operator checks)."""
    recording = torch.is_grad_enabled()
    spans = []
    for g in grads:
        if g.layout is not torch.strided or not g.is_contiguous() or g.is_inference():
            return False
        if g.is_neg() or (recording and g.requires_grad):
            return False
        if g.numel():
            spans.append((g.data_ptr(), g.data_ptr() + 4 * g.numel()))
    spans.sort()
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


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
    """SIGTERM asked the training loop to stop (raised by :meth:`StopSignals.check`).

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` never swallows it."""


class ForcedStop(KeyboardInterrupt):
    """A second Ctrl-C while a stop was pending: raised at once, wherever the loop was, so the
    state may be half a step and must not be checkpointed."""


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM during training, acted on only between two steps.

    The first signal is recorded; :meth:`check`, called at the top of every step, then raises
    KeyboardInterrupt or :class:`Terminated`, so the checkpoint that follows holds whole steps
    (an exception raised inside ``optimizer.step()`` would save half-updated weights, one raised
    inside a library's queue could leave its writer thread unable to close). A second SIGINT
    raises :class:`ForcedStop` at once, for a step that never ends.

    Handlers are installed only in the main thread (the only one Python lets set them; elsewhere
    this object does nothing) and :meth:`restore` puts the previous ones back.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise ForcedStop
        if self.received is None:
            self.received = signum

    def check(self) -> None:
        """Raise KeyboardInterrupt (SIGINT) or Terminated (SIGTERM) if one was received."""
        if self.received == signal.SIGTERM:
            raise Terminated
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()
