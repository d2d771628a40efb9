"""lmlab's own CPU kernels for weight-only quantized linear layers at few rows (decode).

Legend: M rows of x (1..:data:`MAX_ROWS`), N out_features, K in_features (a multiple of G), G group
size. ``int8_mm(x, q, s, G)`` and ``int4_mm(x, p, s, z, G)`` return y (M, N) float32 =
x @ w_hat.T for the formats of :mod:`lmlab.nn.quant` (int8: w_hat = q s; int4, p the
:func:`~lmlab.nn.quant.pack_int4` bytes: w_hat = (code - 8) s + z), reading the stored buffers as
they are (no second copy of the weight). The loop is in ``quant_kernels.cpp`` next to this file:
each output row's codes are dequantized 8 at a time to float32 (AVX2 + FMA where the CPU has them;
int4 16 at a time with AVX-512F where it has that)
and multiply-added into M float32 accumulators, output rows split over threads by
``at::parallel_for`` (``torch.set_num_threads``).

It is compiled on first use by ``torch.utils.cpp_extension.load`` into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; about 10-30 s once, then a
cached load) and called through ctypes with the tensors' data pointers (only ATen/Parallel.h is
included, which keeps the compile short). When it cannot be used (``LMLAB_NO_CPP_KERNELS=1``, no
C++ compiler, a failed build) :func:`available` is False, the reason is warned once and kept in
:func:`status`, and QuantLinear uses torch's kernels / dequantize + matmul instead.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("quant_kernels.cpp")
MAX_ROWS = 8  # the C++ kernels' compile-time row counts are 1..8
ENV_OFF = "LMLAB_NO_CPP_KERNELS"
OFF_VALUES = ("", "0", "false", "no", "off")  # LMLAB_NO_CPP_KERNELS values that keep the kernels

_lib: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet
_off = False  # inside disabled()


def _cpu_has_avx2_fma() -> bool:
    """True when torch reports AVX2 (or better) and /proc/cpuinfo lists fma."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " fma" in flags and " avx2" in flags


def _cpu_has_avx512f() -> bool:
    """True when torch reports AVX512 and /proc/cpuinfo lists avx512f."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _build() -> ctypes.CDLL:
    """Compile (or load from torch's cache) quant_kernels.cpp; raises on any failure."""
    from torch.utils.cpp_extension import load

    avx2 = _cpu_has_avx2_fma()
    avx512 = avx2 and _cpu_has_avx512f()
    flags = ["-O3", "-fopenmp", *(["-mavx2", "-mfma"] if avx2 else [])]
    flags += ["-mavx512f"] if avx512 else []
    kind = "avx512" if avx512 else "avx2" if avx2 else "generic"
    path = load(
        name=f"lmlab_quant_kernels_{kind}",
        sources=[str(SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    lib = ctypes.CDLL(str(path))
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    lib.lmlab_int4_mm.argtypes = [fp, i64, i64, fp, fp, fp, i64, i64, fp]
    lib.lmlab_int8_mm.argtypes = [fp, i64, i64, fp, fp, i64, i64, fp]
    lib.lmlab_int4_mm.restype = lib.lmlab_int8_mm.restype = ctypes.c_int
    if lib.lmlab_kernels_max_rows() != MAX_ROWS:
        raise RuntimeError("quant_kernels.cpp and quant_kernel.py disagree on MAX_ROWS")
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _status
    if _status is None:
        if os.environ.get(ENV_OFF, "").strip().lower() not in OFF_VALUES:
            _status = f"disabled by {ENV_OFF}={os.environ[ENV_OFF]}"
        else:
            try:
                _lib = _build()
                _status = (
                    "avx512f+avx2+fma"
                    if _lib.lmlab_kernels_avx512()
                    else "avx2+fma"
                    if _lib.lmlab_kernels_avx2()
                    else "generic C++ (no AVX2)"
                )
            except Exception as e:  # no compiler, a failed build, an unloadable library
                _lib = None
                _status = f"unavailable: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
        if _lib is None:
            warnings.warn(
                f"lmlab's C++ quantized kernels are not used ({_status}); QuantLinear falls back "
                "to torch's int8/int4 kernels or dequantize + matmul",
                RuntimeWarning,
                stacklevel=3,
            )
    return _lib


def available() -> bool:
    """Whether the compiled kernels can be used (compiles them on the first call); False inside
    :func:`disabled`."""
    return not _off and _load() is not None


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block QuantLinear does not use these kernels (A/B benchmarks, tests)."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


def status() -> str:
    """``avx512f+avx2+fma``, ``avx2+fma``, ``generic C++ (no AVX2)``, or why the kernels are
    not used (after :func:`available` has been asked; ``not loaded yet`` before)."""
    return _status or "not loaded yet"


def _reset() -> None:
    """Forget the load result (tests)."""
    global _lib, _status
    _lib, _status = None, None


def _check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, k: int, g: int) -> None:
    if not (x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError(f"x must be (M <= {MAX_ROWS}, K) float32, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] != k or k % g or s.shape != (w.shape[0], k // g) or s.dtype != torch.float32:
        raise ValueError("x, weight and scales shapes disagree")
    if not (x.is_contiguous() and w.is_contiguous() and s.is_contiguous()):
        raise ValueError("operands must be contiguous")
    if not (x.device.type == w.device.type == s.device.type == "cpu"):
        raise ValueError("operands must be on the CPU")


def int8_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: int) -> torch.Tensor:
    """x (M, K) float32, q (N, K) int8, s (N, K/G) float32 -> (M, N) float32 = x @ (q s).T.
    Raises ValueError for operands the kernel does not take, RuntimeError if unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"lmlab's C++ kernels are not available: {_status}")
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError("int8 weight must be (N, K) int8")
    _check(x, q, s, q.shape[1], g)
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n)
    if lib.lmlab_int8_mm(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), n, g, y.data_ptr()):
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y


def int4_mm(
    x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int
) -> torch.Tensor:
    """x (M, K) float32, p (N, K/2) uint8 (two codes per byte, low nibble first), s and z (N, K/G)
    float32 -> (M, N) float32 = x @ ((code - 8) s + z).T group-wise. Raises ValueError for
    operands the kernel does not take, RuntimeError if unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"lmlab's C++ kernels are not available: {_status}")
    if p.dtype != torch.uint8 or p.dim() != 2 or g % 2 or z.shape != s.shape:
        raise ValueError("int4 weight must be (N, K/2) uint8 with an even group and zeros = scales")
    if z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError("zeros must be contiguous float32")
    _check(x, p, s, 2 * p.shape[1], g)
    m, k = x.shape
    n = p.shape[0]
    y = torch.empty(m, n)
    if lib.lmlab_int4_mm(
        x.data_ptr(), m, k, p.data_ptr(), s.data_ptr(), z.data_ptr(), n, g, y.data_ptr()
    ):
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y


def run(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int,
    bits: int,
) -> torch.Tensor:  # fmt: skip
    """QuantLinear's call: :func:`int8_mm` / :func:`int4_mm` without their operand checks (the
    layer checked its buffers when it prepared them; x (M <= MAX_ROWS, K) contiguous float32).
    Requires :func:`available`."""
    assert _lib is not None
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n)
    if bits == 8:
        bad = _lib.lmlab_int8_mm(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, g, y.data_ptr()
        )
    else:
        bad = _lib.lmlab_int4_mm(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, g,
            y.data_ptr(),
        )  # fmt: skip
    if bad:
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y
