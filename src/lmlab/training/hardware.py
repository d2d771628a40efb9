"""Devices, autocast settings and this machine's measured matrix-multiply peak (for MFU)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from lmlab.errors import LmlabError

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu. Raises LmlabError for a device that is absent."""
    if name not in DEVICES:
        raise LmlabError(f"--device {name!r} is not one of: {', '.join(DEVICES)}")
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if has_mps else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmlabError("--device cuda was asked for, but torch sees no CUDA GPU here")
    if name == "mps" and not has_mps:
        raise LmlabError("--device mps was asked for, but this machine has no MPS backend")
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` for precision ``bf16``; a no-op for ``fp32``."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _timed() -> Iterator[list[float]]:
    out: list[float] = []
    t = time.perf_counter()
    yield out
    out.append(time.perf_counter() - t)


def measure_matmul_peak(device: torch.device, precision: str, seconds: float = 0.3) -> float:
    """Measured dense matmul throughput in FLOP/s at the training dtype (the MFU denominator).

    Times square matmuls of size 1024 (4096 on GPU) for about ``seconds`` and returns the best
    rate, 2 n^3 FLOPs per matmul. This machine's number, not a datasheet constant.
    """
    n = 4096 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    torch.matmul(a, b)  # warm-up
    while True:
        synchronize(device)
        with _timed() as t:
            torch.matmul(a, b)
            synchronize(device)
        best = min(best, t[0])
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best
