"""lmlab's own CPU kernels for weight-only quantized linear layers at few rows (decode).

Legend: M rows of x (1..:data:`MAX_ROWS`), N out_features, K in_features (a multiple of G), G group
size. ``int8_mm(x, q, s, G)`` and ``int4_mm(x, p, s, z, G)`` return y (M, N) float32 =
x @ w_hat.T for the formats of :mod:`lmlab.nn.quant` (int8: w_hat = q s; int4, p the
:func:`~lmlab.nn.quant.pack_int4` bytes: w_hat = (code - 8) s + z), reading the stored buffers as
they are (no second copy of the weight). The loop is in ``quant_kernels.cpp`` next to this file:
each output row's codes are dequantized 8 at a time to float32 (AVX2 + FMA where the CPU has them;
with AVX-512F, int4 groups of a multiple of 32 and int8 groups of a multiple of 16 take wider
paths: 16-32 codes per step, 4 output rows per pass sharing the loads of x)
and multiply-added into M float32 accumulators, output rows split over threads by
``at::parallel_for`` (``torch.set_num_threads``; ranges of at least 64K weights, so decode's
layers use both threads of a 2-core machine; the numbers do not depend on the thread count).

With ``act_bits=8`` (``QuantLinear(act_bits=8)``, ``--quantize int4+a8``) the kernels first
quantize each row of x to int8 per block of 32 columns (one float32 scale per block, and the
block's sum for int4's offset term, as llama.cpp's Q8_0 / Q8_1 activations), then take integer
dot products per block: AVX512-VNNI ``vpdpbusd`` (built with ``-mavx512vnni -mavx512vl
-mavx512bw`` where /proc/cpuinfo lists them; int4 weights 4 blocks of 32 per 512-bit step), else
AVX-VNNI (``-mavxvnni``), else AVX2's ``maddubs`` + ``madd``, else plain loops; the result is
scaled by weight scale x activation scale in float32. It equals x_hat @ w_hat.T with x_hat =
:func:`lmlab.nn.quant.fake_quantize_activations` (tests/unit/test_quant_act8.py).

It is compiled on first use by :func:`lmlab.nn.cpp_build.build` (``torch.utils.cpp_extension.
load`` into a folder under torch's extension root, ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``; a build killed half-way is not waited for forever; about 10-30 s
once, then a cached load) and called through ctypes with the tensors' data pointers (only
ATen/Parallel.h is included, which keeps the compile short). When it cannot be used
(``LMLAB_NO_CPP_KERNELS=1``, no C++ compiler, a failed build) :func:`available` is False, the
reason is warned once and kept in :func:`status`, and QuantLinear uses torch's kernels /
dequantize + matmul instead.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmlab.nn import cpp_build
from lmlab.training.hardware import cpu_flags

SOURCE = Path(__file__).with_name("quant_kernels.cpp")
MAX_ROWS = 8  # the C++ kernels' compile-time row counts are 1..8
ENV_OFF, OFF_VALUES = cpp_build.ENV_OFF, cpp_build.OFF_VALUES


def build_flags(limit: str | None = None) -> tuple[list[str], str]:
    """(compiler flags, kind) for quant_kernels.cpp on this CPU: the instruction sets the
    kernels use, and a name for that set (``avx512_vnni512``, ``avx2``, ``generic`` ...; part
    of the extension's name, torch's cache key). ``limit`` as in :func:`_build`. Also the
    flags of :mod:`lmlab.nn.decode_kernel`, which compiles this source into its library."""
    avx2 = cpp_build.cpu_has_avx2_fma() and limit != "generic"
    avx512 = avx2 and cpp_build.cpu_has_avx512f() and limit in (None, "avx512")
    flags = ["-O3", "-fopenmp", *(["-mavx2", "-mfma"] if avx2 else [])]
    flags += ["-mavx512f"] if avx512 else []
    kind = "avx512" if avx512 else "avx2" if avx2 else "generic"
    # the int8-activation kernels' dot product: AVX512-VNNI (256-bit, needs VL), else AVX-VNNI,
    # else AVX2's maddubs; each flag set gets its own extension name (torch's cache key)
    cpu = cpu_flags()
    if avx512 and limit is None and {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu:
        flags += ["-mavx512vnni", "-mavx512vl", "-mavx512bw"]
        kind += "_vnni512"
    elif avx2 and "avx_vnni" in cpu and limit in (None, "avxvnni"):
        flags += ["-mavxvnni"]
        kind += "_avxvnni"
    return flags, kind


def _build(limit: str | None = None, source: Path | None = None) -> ctypes.CDLL:
    """Compile (or load from the cache) quant_kernels.cpp; raises on any failure.
    ``source``: another version of that file (benchmarks/quant_kernel_ab.py ``--baseline``),
    built with the same flags under a name of its own (its content's hash).
    ``limit`` (tests: the other paths on a CPU that has more): ``generic`` builds without
    instruction-set flags, ``avx2`` with AVX2 + FMA only (no AVX-512, no VNNI), ``avxvnni``
    with AVX2 + FMA + AVX-VNNI (where the CPU lists avx_vnni), ``avx512`` with AVX-512F but no
    VNNI (where the CPU has AVX-512F)."""
    flags, kind = build_flags(limit)
    if source is not None:
        kind += "_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    src = str(source or SOURCE)
    path = cpp_build.build(f"lmlab_quant_kernels_{kind}", [src], flags, ["-fopenmp"])
    lib = ctypes.CDLL(str(path))
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    lib.lmlab_int4_mm.argtypes = [fp, i64, i64, fp, fp, fp, i64, i64, fp]
    lib.lmlab_int8_mm.argtypes = [fp, i64, i64, fp, fp, i64, i64, fp]
    lib.lmlab_a8_mm.argtypes = [ctypes.c_int, fp, i64, i64, fp, fp, fp, i64, i64, fp]
    lib.lmlab_int4_mm.restype = lib.lmlab_int8_mm.restype = lib.lmlab_a8_mm.restype = ctypes.c_int
    lib.lmlab_dequantize.argtypes = [ctypes.c_int, fp, fp, fp, i64, i64, i64, fp]
    lib.lmlab_dequantize.restype = ctypes.c_int
    if lib.lmlab_kernels_max_rows() != MAX_ROWS:
        raise RuntimeError("quant_kernels.cpp and quant_kernel.py disagree on MAX_ROWS")
    return lib


def _describe(lib: ctypes.CDLL) -> str:
    status = (
        "avx512f+avx2+fma"
        if lib.lmlab_kernels_avx512()
        else "avx2+fma"
        if lib.lmlab_kernels_avx2()
        else "generic C++ (no AVX2)"
    )
    return status + {1: "+avx512vnni", 2: "+avxvnni"}.get(lib.lmlab_kernels_vnni(), "")


_kernels = cpp_build.LazyLibrary(
    lambda: _build(),  # looked up at call time (tests replace _build)
    _describe,
    "lmlab's C++ quantized kernels are not used; QuantLinear falls back to torch's int8/int4 "
    "kernels or dequantize + matmul",
)


def _load() -> ctypes.CDLL | None:
    return _kernels.load()


def available() -> bool:
    """Whether the compiled kernels can be used (compiles them on the first call); False inside
    :func:`disabled`."""
    return _kernels.available()


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block QuantLinear does not use these kernels (A/B benchmarks, tests)."""
    with _kernels.disabled():
        yield


def status() -> str:
    """``avx512f+avx2+fma``, ``avx2+fma``, ``generic C++ (no AVX2)`` (with ``+avx512vnni`` or
    ``+avxvnni`` where the int8-activation kernels use VNNI), or why the kernels are not used
    (after :func:`available` has been asked; ``not loaded yet`` before)."""
    return _kernels.status()


def _reset() -> None:
    """Forget the load result (tests)."""
    _kernels.reset()


def _check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, k: int, g: int) -> None:
    if not (x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError(f"x must be (M <= {MAX_ROWS}, K) float32, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] != k or k % g or s.shape != (w.shape[0], k // g) or s.dtype != torch.float32:
        raise ValueError("x, weight and scales shapes disagree")
    if not (x.is_contiguous() and w.is_contiguous() and s.is_contiguous()):
        raise ValueError("operands must be contiguous")
    if not (x.device.type == w.device.type == s.device.type == "cpu"):
        raise ValueError("operands must be on the CPU")


def int8_mm(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: int, act_bits: int | None = None
) -> torch.Tensor:
    """x (M, K) float32, q (N, K) int8, s (N, K/G) float32 -> (M, N) float32 = x @ (q s).T;
    ``act_bits=8``: x is first quantized to int8 per block (:func:`lmlab.nn.quant.
    quantize_activations`) and the products are integer dot products. Raises ValueError for
    operands the kernel does not take, RuntimeError if unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"lmlab's C++ kernels are not available: {status()}")
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError("int8 weight must be (N, K) int8")
    _check(x, q, s, q.shape[1], g)
    m, k = x.shape
    n = q.shape[0]
    _check_act_bits(act_bits)
    y = torch.empty(m, n)
    if act_bits == 8:
        bad = lib.lmlab_a8_mm(8, x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), s.data_ptr(), n,
                              g, y.data_ptr())  # fmt: skip
    else:
        bad = lib.lmlab_int8_mm(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), n, g, y.data_ptr())
    if bad:
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y


def int4_mm(
    x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int,
    act_bits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (M, K) float32, p (N, K/2) uint8 (two codes per byte, low nibble first), s and z (N, K/G)
    float32 -> (M, N) float32 = x @ ((code - 8) s + z).T group-wise; ``act_bits=8`` as in
    :func:`int8_mm`. Raises ValueError for operands the kernel does not take, RuntimeError if
    unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"lmlab's C++ kernels are not available: {status()}")
    if p.dtype != torch.uint8 or p.dim() != 2 or g % 2 or z.shape != s.shape:
        raise ValueError("int4 weight must be (N, K/2) uint8 with an even group and zeros = scales")
    if z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError("zeros must be contiguous float32")
    _check(x, p, s, 2 * p.shape[1], g)
    m, k = x.shape
    n = p.shape[0]
    _check_act_bits(act_bits)
    y = torch.empty(m, n)
    args = (x.data_ptr(), m, k, p.data_ptr(), s.data_ptr(), z.data_ptr(), n, g, y.data_ptr())
    if lib.lmlab_a8_mm(4, *args) if act_bits == 8 else lib.lmlab_int4_mm(*args):
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y


def _check_act_bits(act_bits: int | None) -> None:
    if act_bits not in (None, 8):
        raise ValueError(f"act_bits must be None (float activations) or 8, got {act_bits!r}")


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int, bits: int
) -> torch.Tensor:
    """QuantLinear's weight (N, Kp) float32 = (code - c) s + z group-wise (c = 0 for int8, 8 for
    int4; :func:`lmlab.nn.quant.dequantize_weight`'s formula, one pass instead of its six torch
    ops), for products of more rows than the kernels take: qweight (N, Kp) int8 or (N, Kp/2)
    uint8, scales and zeros (N, Kp/G) float32, all contiguous on the CPU (the layer's
    ``_cpp_ok``). Requires :func:`available`; raises ValueError for sizes the kernel refuses."""
    lib = _kernels.lib
    assert lib is not None
    n, kp = scales.shape[0], scales.shape[1] * g
    w = torch.empty(n, kp)
    args = (qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, kp, g, w.data_ptr())
    if lib.lmlab_dequantize(bits, *args):
        raise ValueError(f"the kernel refused to dequantize N={n} K={kp} G={g} bits={bits}")
    return w


def run(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int,
    bits: int, act_bits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """QuantLinear's call: :func:`int8_mm` / :func:`int4_mm` without their operand checks (the
    layer checked its buffers when it prepared them; x (M <= MAX_ROWS, K) contiguous float32).
    Requires :func:`available`."""
    lib = _kernels.lib
    assert lib is not None
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n)
    if act_bits == 8:
        bad = lib.lmlab_a8_mm(
            bits, x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n,
            g, y.data_ptr(),
        )  # fmt: skip
    elif bits == 8:
        bad = lib.lmlab_int8_mm(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, g, y.data_ptr()
        )
    else:
        bad = lib.lmlab_int4_mm(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, g,
            y.data_ptr(),
        )  # fmt: skip
    if bad:
        raise ValueError(f"the kernel refused M={m} K={k} N={n} G={g}")
    return y
