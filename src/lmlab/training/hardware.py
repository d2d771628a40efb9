"""Devices, autocast settings and this machine's measured matrix-multiply peak (for MFU)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

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
    for _ in range(3):  # warm-up: thread pool, caches, clocks
        torch.matmul(a, b)
    deadline = time.perf_counter() + seconds
    while True:
        synchronize(device)
        with _timed() as t:
            torch.matmul(a, b)
            synchronize(device)
        best = min(best, t[0])
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


def cache_dir() -> Path:
    """Where lmlab keeps per-machine measurements: ``$LMLAB_CACHE_DIR`` or ``~/.cache/lmlab``."""
    return Path(os.environ.get("LMLAB_CACHE_DIR") or Path.home() / ".cache" / "lmlab")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_peak(device: torch.device, precision: str) -> float:
    """This machine's matmul peak in FLOP/s: the best of a fresh measurement and the best one
    recorded before (in ``cache_dir()/matmul_peak.json``, keyed by device, precision and thread
    count). A single short measurement can read low while other work shares the cores; the
    recorded best keeps MFU comparable between runs."""
    measured = measure_matmul_peak(device, precision)
    key = f"{device.type}|{_device_name(device)}|{precision}|threads={torch.get_num_threads()}"
    path = cache_dir() / "matmul_peak.json"
    try:
        known = json.loads(path.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    best = max(measured, float(known.get(key, 0.0)))
    if best > float(known.get(key, 0.0)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**known, key: best}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs MFU stability
    return best
