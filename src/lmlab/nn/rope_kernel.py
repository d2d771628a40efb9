"""lmlab's CPU kernel for RoPE in training: q and k rotated in one pass, forward and backward.

Legend: B batch, N heads (q heads, k heads, or both joined on the head dim), T tokens, hd
head_dim (even), h = hd / 2. :func:`rope` computes ``x * cos + roll(x, h) * signed`` (the
half-split rotation of :meth:`lmlab.nn.position.RotaryPosition.rotate_heads`, ``signed`` =
[-sin1, sin2]) and :class:`RopeFunction` its gradient ``g * cos + roll(g * signed, -h)``, each in
one pass over the tensor where torch's eager formula makes four (three products or copies and a
sum, each a full read and write). Bit-equal to the eager formula in float32 and bfloat16: the
products and the sum round as torch's ops round them (see ``rope_kernels.cpp``).

Compiled on first use by :func:`lmlab.nn.cpp_build.build` (``torch.utils.cpp_extension.load``
into torch's extension root, guarded against a killed build's stale lock; a few seconds once,
then a cached load) and called through ctypes with the tensors' data pointers, as
:mod:`lmlab.nn.quant_kernel` does. When it cannot be used (``LMLAB_NO_CPP_KERNELS=1``, no C++
compiler, a failed build) :func:`available` is False, the reason is kept in :func:`status`, and
RoPE runs as torch ops (the same values).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmlab.nn import cpp_build

SOURCE = Path(__file__).with_name("rope_kernels.cpp")
OPS_SOURCE = Path(__file__).with_name("rope_ops.cpp")  # torch.ops.lmlab.rope_split
MAX_HEAD_DIM = 1024  # the kernel's per-row buffers (rope_kernels.cpp kMaxHeadDim)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _build() -> ctypes.CDLL:
    """Compile (or load from the cache) rope_kernels.cpp and rope_ops.cpp into one library,
    which registers torch.ops.lmlab.rope_split; raises on any failure."""
    avx2 = cpp_build.cpu_has_avx2_fma()
    avx512 = avx2 and cpp_build.cpu_has_avx512f()
    # no fused multiply-add (-ffp-contract=off): each product rounds as torch's eager mul does
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", *(["-mavx2"] if avx2 else [])]
    flags += ["-mavx512f"] if avx512 else []
    kind = "avx512" if avx512 else "avx2" if avx2 else "generic"
    sources = [str(SOURCE), str(OPS_SOURCE)]
    path = cpp_build.build(f"lmlab_rope_kernels_{kind}", sources, flags, ["-fopenmp"])
    if not hasattr(torch.ops.lmlab, "rope_split"):  # registered when the library was loaded
        raise RuntimeError(f"{path} did not register torch.ops.lmlab.rope_split")
    lib = ctypes.CDLL(str(path))
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    # argtypes set whole: ctypes converts arguments by the list given at assignment (an
    # appended type is never used, so a pointer there would be passed as a 32-bit int)
    lib.lmlab_rope.argtypes = [
        ctypes.c_int,
        fp,
        *[i64] * 7,
        fp,
        fp,
        fp,
        i64,
        i64,
        i64,
        ctypes.c_int,
    ]
    lib.lmlab_rope.restype = ctypes.c_int
    ci = ctypes.c_int
    lib.lmlab_rope_split.argtypes = [ci, fp, fp, ci, i64, i64, i64, i64, i64, fp, fp, fp, fp, fp]
    lib.lmlab_rope_split.restype = ci
    lib.lmlab_rope_split_backward.argtypes = [ci, fp, fp, fp, *[i64] * 5, fp, fp, fp, fp]
    lib.lmlab_rope_split_backward.restype = ci
    if lib.lmlab_rope_max_head_dim() != MAX_HEAD_DIM:
        raise RuntimeError("rope_kernels.cpp and rope_kernel.py disagree on MAX_HEAD_DIM")
    return lib


_kernel = cpp_build.LazyLibrary(lambda: _build(), lambda lib: "compiled")


def _load() -> ctypes.CDLL | None:
    return _kernel.load()


def available() -> bool:
    """Whether the compiled kernel can be used (compiles it on the first call); False inside
    :func:`disabled`."""
    return _kernel.available()


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block RoPE runs as torch ops (A/B benchmarks, tests)."""
    with _kernel.disabled():
        yield


def status() -> str:
    """``compiled``, or why the kernel is not used (``not loaded yet`` before the first use)."""
    return _kernel.status()


def applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope` takes x (B, N, T, hd) with tables ``cos`` (T, hd): CPU, float32 or
    bfloat16 (one dtype), contiguous last dim, shared positions (2-d tables), an even hd <=
    :data:`MAX_HEAD_DIM`, tables that record no gradient (the kernel returns none for them: a
    trainable frequency table keeps torch's ops); and the kernel available."""
    return (
        x.device.type == "cpu"
        and not (cos.requires_grad and torch.is_grad_enabled())
        and x.dim() == 4
        and x.dtype in _DTYPES
        and cos.dtype == x.dtype
        and cos.dim() == 2
        and cos.shape == x.shape[2:]
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and x.shape[-1] <= MAX_HEAD_DIM
        and available()
    )


def _into(
    x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor, out: torch.Tensor, inverse: bool
) -> torch.Tensor:
    """Rotate x (B, N, T, hd) into ``out`` (B, N, T, hd), each with any strides but a last one
    of 1, not overlapping; ``inverse``: the gradient's rotation. Returns ``out``."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"lmlab's RoPE kernel is not available: {status()}")
    b, n, t, hd = x.shape
    if out.shape != x.shape or out.dtype != x.dtype or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out must have one shape and dtype and a last stride of 1")
    cos, signed = cos.contiguous(), signed.contiguous()
    sx, so = x.stride(), out.stride()
    rc = lib.lmlab_rope(
        _DTYPES[x.dtype], x.data_ptr(), b, n, t, hd, sx[0], sx[1], sx[2],
        cos.data_ptr(), signed.data_ptr(), out.data_ptr(), so[0], so[1], so[2], int(inverse),
    )  # fmt: skip
    if rc:
        raise ValueError(f"the RoPE kernel refused head_dim {hd}")
    return out


def _call(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x (B, N, T, hd) -> (B, N, T, hd) laid out in memory as (B, T, N, hd) (the layout torch's
    elementwise ops give a head-transposed projection, and its gradient). An x whose last
    stride is not 1 (a gradient from a transposed matmul) is made contiguous first."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, n, t, hd = x.shape
    out = torch.empty(b, t, n, hd, dtype=x.dtype, device=x.device).transpose(1, 2)
    return _into(x, cos, signed, out, inverse)


class RopeFunction(torch.autograd.Function):
    """y = x * cos + roll(x, h) * signed, backward dx = g * cos + roll(g * signed, -h), each one
    kernel pass (:func:`_call`); x (B, N, T, hd), cos and signed (T, hd) of x's dtype (no
    gradient). Returns y laid out as (B, T, N, hd) in memory, as the eager formula's result."""

    @staticmethod
    def forward(ctx, x, cos, signed):
        ctx.save_for_backward(cos, signed)
        return _call(x, cos, signed, inverse=False)

    @staticmethod
    def backward(ctx, g):
        cos, signed = ctx.saved_tensors
        if torch.is_grad_enabled() and g.requires_grad:  # create_graph: differentiable ops
            return _inverse_ops(g, cos, signed), None, None
        return _call(g, cos, signed, inverse=True), None, None


def _inverse_ops(g: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """The rotation's gradient as torch ops, g * cos + roll(g * signed, -hd / 2): what the
    kernels compute, but recorded by autograd, for a backward that builds a graph
    (``create_graph=True``, e.g. a gradient penalty), where the kernel's result would carry
    none and second-order gradients would silently be missing. g (..., T, hd)."""
    return g * cos + torch.roll(g * signed, -(g.shape[-1] // 2), dims=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """x (B, N, T, hd) float32 or bfloat16 rotated by ``cos`` and ``signed`` ([-sin1, sin2])
    (T, hd) of its dtype: ``x * cos + roll(x, hd / 2) * signed``, bit-equal, differentiable.
    Raises RuntimeError when the kernel is unavailable (check :func:`applies` first)."""
    return RopeFunction.apply(x, cos, signed)


def rope_split_op(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed: torch.Tensor,
    h: int,
    kv: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope_split` without its checks, for callers that made them
    (:meth:`lmlab.nn.position.RotaryPosition.rotate_split`): torch.ops.lmlab.rope_split
    (rope_ops.cpp), the autograd in C++. qkv (B, T, H + 2 K, hd) -> q (B, H, T, hd) and k (B,
    K, T, hd) rotated, v (B, K, T, hd), each contiguous (what batched-matmul attention reads
    without a copy), in ONE kernel call; with ``bias`` ((H + 2 K) hd,), the projection's bias,
    added first (qkv is then the bias-free matmul's output; each sum rounded to qkv's dtype, as
    a biased matmul's output is). Backward, one call: the three gradients into one (B, T, H +
    2 K, hd) tensor, q's and k's rotated back (no concatenation, no transposed copies), and the
    bias gradient (its column sums, in float32, in the same pass). A backward that records its
    own graph (create_graph) runs the gradient as ATen ops (the same values). Without a bias
    the values and gradients are :func:`rope`'s (the rolled formula), bit for bit."""
    q, k, v = torch.ops.lmlab.rope_split(qkv, cos, signed, h, kv, bias)
    return q, k, v


def rope_split(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed: torch.Tensor,
    h: int,
    kv: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (B, T, H + 2 K, hd) float32 or bfloat16 (+ ``bias`` ((H + 2 K) hd,) float32 or qkv's
    dtype, or None) -> (q (B, H, T, hd), k (B, K, T, hd)) rotated as :func:`rope` rotates them
    and v (B, K, T, hd), each contiguous; differentiable in qkv and bias
    (:func:`rope_split_op`). Raises ValueError for inputs it cannot read (h or kv negative
    or not ints, shapes, dtypes, devices) and RuntimeError when the kernel is unavailable."""
    if not (isinstance(h, int) and isinstance(kv, int) and h >= 0 and kv >= 0):
        raise ValueError(f"rope_split: h and kv must be head counts (ints >= 0), not {h}, {kv}")
    b, t, heads, hd = qkv.shape if qkv.dim() == 4 else (0, 0, -1, 0)
    if heads != h + 2 * kv or qkv.device.type != "cpu" or qkv.dtype not in _DTYPES:
        raise ValueError(
            f"rope_split: qkv must be a float32 or bfloat16 CPU tensor (B, T, {h + 2 * kv}, hd), "
            f"not {qkv.dtype} {tuple(qkv.shape)} on {qkv.device}"
        )
    if cos.shape != (t, hd) or signed.shape != (t, hd) or {cos.dtype, signed.dtype} != {qkv.dtype}:
        raise ValueError(f"rope_split: cos and signed must be ({t}, {hd}) of qkv's dtype")
    if cos.device.type != "cpu" or signed.device.type != "cpu":
        raise ValueError("rope_split: cos and signed must be CPU tensors")
    if torch.is_grad_enabled() and (cos.requires_grad or signed.requires_grad):
        raise ValueError(
            "rope_split: cos and signed must not record gradients (the kernel returns none "
            "for them)"
        )
    if bias is not None and (
        bias.shape != (heads * hd,)
        or bias.device.type != "cpu"
        or bias.dtype not in (torch.float32, qkv.dtype)
    ):
        raise ValueError(
            f"rope_split: bias must be ({heads * hd},) float32 or qkv's dtype on the CPU, not "
            f"{bias.dtype} {tuple(bias.shape)} on {bias.device}"
        )
    if not available():
        raise RuntimeError(f"lmlab's RoPE kernel is not available: {status()}")
    return rope_split_op(qkv, cos, signed, h, kv, bias)
