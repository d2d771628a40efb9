"""Devices, autocast settings and this machine's measured matrix-multiply peak (for MFU)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmlab.errors import LmlabError

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "bf16", "fp32")

# /proc/cpuinfo flags of CPUs with bf16 arithmetic units (x86: AVX-512 BF16, AMX; Arm: BF16).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


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


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU listed in ``cpuinfo`` (Linux ``flags`` on x86,
    ``Features`` on Arm); empty where the file is absent or unreadable (macOS, Windows)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for _, line in zip(range(200), f, strict=False):  # the first CPU's block is short
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def has_fast_bf16(device: torch.device, flags: set[str] | None = None) -> bool:
    """Whether bf16 autocast is expected to run faster than float32 on ``device``: a CUDA GPU
    that supports bf16, or a CPU with bf16 arithmetic units (``BF16_CPU_FLAGS`` in
    ``flags``, read from /proc/cpuinfo when None). A CPU without them emulates bf16 matmuls
    (measured on an AMD EPYC with AVX2 only: a 1024 x 1024 matmul 2.5 s in bf16 against
    0.02 s in float32, a 98 vs 2,400 characters/s training run), and MPS autocast is refused."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    return bool((_this_cpu_flags() if flags is None else flags) & set(BF16_CPU_FLAGS))


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    return frozenset(cpu_flags())


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` as a run uses it: ``auto`` is ``bf16`` where :func:`has_fast_bf16`
    holds on ``device`` and ``fp32`` elsewhere; ``bf16`` and ``fp32`` are returned as given."""
    if precision != "auto":
        return precision
    return "bf16" if has_fast_bf16(device) else "fp32"


def planned_precision(train: Any) -> str:
    """The precision a run of ``train`` (a TrainConfig) would use on this machine without
    starting one: ``auto`` resolved against the device :func:`resolve_device` picks for
    ``train.device`` (a device this machine lacks counts as the CPU)."""
    if train.precision != "auto":
        return str(train.precision)
    try:
        device = resolve_device(train.device)
    except LmlabError:
        device = torch.device("cpu")
    return resolve_precision("auto", device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` for precision ``bf16``; a no-op for ``fp32``; ``auto`` as
    :func:`resolve_precision` picks it for ``device``."""
    if resolve_precision(precision, device) == "bf16":
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


def measure_matmul_peak(
    device: torch.device, precision: str, seconds: float = 0.3, trials: int = 5
) -> float:
    """Measured dense matmul throughput in FLOP/s at the training dtype (the MFU denominator).

    Times square matmuls of size 1024 (4096 on GPU) in ``trials`` bursts spread over about
    ``seconds`` (a short pause between bursts lets a competing process's time slice pass) and
    returns the best rate, 2 n^3 FLOPs per matmul. This machine's number, not a datasheet
    constant; it can only read low (cores or GPU shared), never high.
    """
    n = 4096 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):  # warm-up: thread pool, caches, clocks
        synchronize(device)
        with _timed() as t:
            torch.matmul(a, b)
            synchronize(device)
        if t[0] > seconds:  # a slow path (bf16 on a CPU without bf16 units: ~2.5 s a matmul):
            with _timed() as t:  # one more, timed warm, is a long enough sample on its own
                torch.matmul(a, b)
                synchronize(device)
            return 2 * n**3 / t[0]
    burst = seconds / (2 * trials)
    for _ in range(trials):
        deadline = time.perf_counter() + burst
        while True:
            synchronize(device)
            with _timed() as t:
                torch.matmul(a, b)
                synchronize(device)
            best = min(best, t[0])
            if time.perf_counter() > deadline:
                break
        time.sleep(burst)
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


# A measurement is refused as the denominator when it is below this fraction of the recorded
# best (something slowed it), or when the CPU was busy while it ran (see _cpu_busy).
LOW_FRACTION = 0.7


@dataclass(frozen=True)
class MatmulPeak:
    """The MFU denominator: ``flops`` FLOP/s (None: no trustworthy peak, MFU is not reported)
    and ``source``, a sentence saying where it comes from (logged at the start of training)."""

    flops: float | None
    source: str


def _cpu_busy(device: torch.device) -> float | None:
    """The 1-minute load average when other work held the cores this process's threads need
    (load average + threads > cores + 0.5), else None. Always None off the CPU and where the
    load average is unknown."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    return load if load + torch.get_num_threads() > _cores() + 0.5 else None


def _read_peaks(path: Path) -> dict[str, float]:
    """The recorded peaks: key -> positive finite FLOP/s; an unreadable or malformed file (or
    entry) counts as absent (it is a cache, rewritten on the next good measurement)."""
    from lmlab.safeio import read_json_object

    try:
        known = read_json_object(path, "matmul peak cache")
    except (OSError, LmlabError):
        return {}
    return {
        k: float(v)
        for k, v in known.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    }


def matmul_peak(device: torch.device, precision: str) -> MatmulPeak:
    """This machine's matmul peak (:func:`measure_matmul_peak`), measured robustly.

    The best good measurement is recorded in ``cache_dir()/matmul_peak.json``, keyed by device,
    precision and thread count. A fresh measurement is good unless the CPU was busy while it ran
    (load average high) or it reads below LOW_FRACTION of the recorded best. The denominator is
    the recorded best (or a new, higher good measurement); with neither good nor recorded peak
    there is none (``flops`` None) rather than one taken under load, which would make MFU read
    above 100%.
    """
    key = f"{device.type}|{_device_name(device)}|{precision}|threads={torch.get_num_threads()}"
    path = cache_dir() / "matmul_peak.json"
    known = _read_peaks(path)
    recorded = known.get(key)
    measured = measure_matmul_peak(device, precision)
    busy = _cpu_busy(device)
    note = f"{measured:.3g} FLOP/s measured now"
    if busy is not None:
        note += f" while the CPU was busy (load average {busy:.1f} on {_cores()} cores)"
    good = busy is None and (recorded is None or measured >= LOW_FRACTION * recorded)
    if good and (recorded is None or measured > recorded):
        _record(path, {**known, key: measured})
        return MatmulPeak(measured, f"{note}, recorded in {path}")
    if recorded is not None:
        why = "" if good or busy is not None else f", below {LOW_FRACTION:.0%} of it: not used"
        best = f"{recorded:.3g} FLOP/s, the best recorded in {path}"
        return MatmulPeak(recorded, f"{best} ({note}{why})")
    return MatmulPeak(None, f"none: {note}, and no earlier good measurement; MFU not reported")


def _cores() -> int:
    from lmlab.training.distributed import available_cores

    return available_cores()


def _record(path: Path, peaks: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(peaks, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs MFU stability
