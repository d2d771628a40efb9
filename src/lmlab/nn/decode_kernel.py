"""lmlab's one-call decode step: every layer of a pre-norm decoder for one new token per row in a
single C++ call (``decode_kernels.cpp``), so a batch-1 step costs its matrix-vector products and
little else.

Legend: B rows (1..:data:`MAX_ROWS`), D d_model, H / KV query / key-value heads, hd head_dim, S
cached tokens before the step, V vocab, N / K a linear layer's out / in features.
:class:`Plan` holds, per layer, the two norms (RMSNorm, LayerNorm with or without weight and bias,
or none), the linear layers (float32 (N, K) weights through this library's own matrix-vector
product, or int8 / int4 / +a8 quantized ones through :mod:`lmlab.nn.quant_kernel`'s C++ kernels,
compiled into the same library), the attention shape and the layer's reserved key / value buffers;
:meth:`Plan.run` takes x (B, D) (the embedded tokens) and the RoPE cos / sin of position S and
writes the logits (B, V). :mod:`lmlab.generation.lean_step` builds the plan from its snapshot and
keeps the cache's bookkeeping.

What the step computes is what the model's forward computes, in another summation order (its own
dot products, norms and softmax in float32), so the logits agree to float32 rounding, not bit for
bit: tests/unit/test_decode_kernel.py bounds the difference.

The float product (:func:`gemv`): 8 / 4 / 2 / 1 output rows at a time for 1 / 2 / 3-4 / 5-8 rows
of x (independent FMA chains), AVX-512 (masked tails) or AVX2 + FMA or plain loops, rows over
threads with ``at::parallel_for`` in tasks of at least 256 KiB of weights.

Compiled on first use by :func:`lmlab.nn.cpp_build.build` with the flags
:func:`lmlab.nn.quant_kernel.build_flags` chooses; unavailable (``LMLAB_NO_CPP_KERNELS=1``, no
compiler, a failed build, or :data:`ENABLED` False) means the caller keeps its Python path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmlab.nn import cpp_build, quant_kernel

SOURCE = Path(__file__).with_name("decode_kernels.cpp")
MAX_ROWS = 8
# False: the lean step keeps its Python loop (A/B benchmarks, tests); see also disabled().
ENABLED = True
# Quantized layers of >= 128 KiB of codes as several kernel calls over the threads (read when a
# plan is built); False: the kernels' own split (only the head) - fewer parallel regions, which
# a machine whose cores are busy with other work punishes (decode_kernels.cpp).
SPLIT_QUANTIZED = True

i64, vp, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double

LIN_KINDS = {(None, None): 0, (8, None): 1, (4, None): 2, (8, 8): 3, (4, 8): 4}
NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
ACTS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


class Lin(ctypes.Structure):
    _fields_ = [("kind", i64), ("n", i64), ("k", i64), ("g", i64), ("w", vp), ("s", vp),
                ("z", vp), ("bias", vp)]  # fmt: skip


class Norm(ctypes.Structure):
    _fields_ = [("kind", i64), ("w", vp), ("b", vp), ("eps", f64)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("n1", Norm), ("qkv", Lin * 3), ("n_qkv", i64), ("o", Lin), ("n2", Norm),
        ("gu", Lin * 2), ("n_gu", i64), ("gated", i64), ("act", i64), ("down", Lin),
        ("heads", i64), ("kv_heads", i64), ("head_dim", i64), ("scale", f64),
        ("kbuf", vp), ("vbuf", vp), ("ks", i64 * 3), ("vs", i64 * 3), ("capacity", i64),
    ]  # fmt: skip


class Model(ctypes.Structure):
    _fields_ = [("n_layers", i64), ("d_model", i64), ("vocab", i64), ("rope", i64),
                ("split_quant", i64),
                ("layers", ctypes.POINTER(Layer)), ("final_norm", Norm), ("head", Lin)]  # fmt: skip


def _build(limit: str | None = None) -> ctypes.CDLL:
    """Compile (or load from the cache) decode_kernels.cpp with quant_kernels.cpp; raises on any
    failure. ``limit`` (tests: the other paths on a CPU that has more) as
    :func:`lmlab.nn.quant_kernel.build_flags` takes it (``avx2``, ``generic``)."""
    flags, kind = quant_kernel.build_flags(limit)
    path = cpp_build.build(
        f"lmlab_decode_kernels_{kind}",
        [str(SOURCE), str(quant_kernel.SOURCE)],
        flags,
        ["-fopenmp"],
    )
    lib = ctypes.CDLL(str(path))
    lib.lmlab_decode_step.argtypes = [ctypes.POINTER(Model), vp, i64, i64, vp, vp, vp]
    lib.lmlab_decode_step.restype = ctypes.c_int
    lib.lmlab_gemv.argtypes = [vp, i64, i64, vp, i64, vp]
    lib.lmlab_gemv.restype = ctypes.c_int
    lib.lmlab_silu_mul.argtypes = [vp, vp, vp, i64]
    lib.lmlab_silu_mul.restype = None
    if lib.lmlab_decode_max_rows() != MAX_ROWS:
        raise RuntimeError("decode_kernels.cpp and decode_kernel.py disagree on MAX_ROWS")
    return lib


_lib = cpp_build.LazyLibrary(
    lambda: _build(),
    lambda lib: {512: "avx512f", 256: "avx2+fma"}.get(lib.lmlab_decode_simd(), "generic C++"),
)


def available() -> bool:
    """Whether the one-call step can be used: :data:`ENABLED`, not inside :func:`disabled`, and
    the library built (compiled on the first call)."""
    return ENABLED and _lib.available()


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block the lean step runs its Python loop (A/B benchmarks, tests)."""
    with _lib.disabled():
        yield


def status() -> str:
    """``avx512f``, ``avx2+fma``, ``generic C++``, or why the library is not used."""
    return _lib.status()


def silu_mul(g: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u (or silu(g)) for contiguous float32 (n,) CPU tensors as the step computes it
    (its own vectorised exp; tests). Raises RuntimeError when unavailable."""
    lib = _lib.load()
    if lib is None:
        raise RuntimeError(f"lmlab's decode kernels are not available: {status()}")
    if g.dtype != torch.float32 or g.dim() != 1 or not g.is_contiguous():
        raise ValueError("silu_mul takes contiguous float32 (n,) tensors")
    if u is not None and (u.shape != g.shape or u.dtype != g.dtype or not u.is_contiguous()):
        raise ValueError("u must be like g")
    out = torch.empty_like(g)
    lib.lmlab_silu_mul(g.data_ptr(), None if u is None else u.data_ptr(), out.data_ptr(), len(g))
    return out


def _reset() -> None:
    _lib.reset()


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M <= 8, K) float32 @ w (N, K) float32 .T -> (M, N), this library's float product
    (benchmarks and tests; contiguous CPU operands). Raises RuntimeError when unavailable,
    ValueError for other operands."""
    lib = _lib.load()
    if lib is None:
        raise RuntimeError(f"lmlab's decode kernels are not available: {status()}")
    ok = (
        x.dtype == w.dtype == torch.float32 and x.dim() == w.dim() == 2
        and x.shape[1] == w.shape[1] and 1 <= x.shape[0] <= MAX_ROWS
        and x.is_contiguous() and w.is_contiguous() and x.device.type == w.device.type == "cpu"
    )  # fmt: skip
    if not ok:
        raise ValueError("gemv takes x (M <= 8, K) and w (N, K) contiguous float32 CPU tensors")
    y = torch.empty(x.shape[0], w.shape[0])
    lib.lmlab_gemv(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
    return y


class Builder:
    """Makes plan entries; holds an alias (``t.detach()``) of every tensor an entry points to,
    so its memory stays valid for the plan's life even if the module's tensor is replaced
    (``.data = ...``: the plan then reads the old values, as lmlab.nn.fused's copies do)."""

    def __init__(self) -> None:
        self.keep: list[torch.Tensor] = []

    def ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        alias = t.detach()
        self.keep.append(alias)
        return alias.data_ptr()

    def float_lin(self, w: torch.Tensor, bias: torch.Tensor | None) -> Lin | None:
        """The plan entry of a float32 linear layer (w (N, K), bias (N,) or None), or None when
        the step cannot read it (another dtype or device, not contiguous)."""
        ts = [t for t in (w, bias) if t is not None]
        if w.dim() != 2 or not all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in ts
        ):
            return None
        if bias is not None and bias.shape != (w.shape[0],):
            return None
        return Lin(0, w.shape[0], w.shape[1], 0, self.ptr(w), None, None, self.ptr(bias))

    def quant_lin(
        self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
        bias: torch.Tensor | None, bits: int, group_size: int, act_bits: int | None,
        in_features: int,
    ) -> Lin | None:  # fmt: skip
        """The plan entry of a quantized layer's stored buffers (lmlab.nn.quant's formats, codes
        spanning exactly ``in_features``), or None where quant_kernels.cpp would refuse it."""
        kind = LIN_KINDS.get((bits, act_bits))
        n, k, g = qweight.shape[0], in_features, group_size
        ok = (
            kind is not None and g >= 1 and k % g == 0 and scales.shape == (n, k // g)
            and zeros.shape == scales.shape
            and (qweight.shape[1] == k if bits == 8 else
                 (g % 2 == 0 and qweight.shape[1] * 2 == k))
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (qweight, scales, zeros))
            and scales.dtype == zeros.dtype == torch.float32
            and qweight.dtype == (torch.int8 if bits == 8 else torch.uint8)
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                                  and bias.shape == (n,) and bias.device.type == "cpu"))
        )  # fmt: skip
        if not ok:
            return None
        return Lin(kind, n, k, g, self.ptr(qweight), self.ptr(scales), self.ptr(zeros),
                   self.ptr(bias))  # fmt: skip

    def norm(self, kind: int, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> Norm:
        return Norm(kind, self.ptr(w), self.ptr(b), eps)


class Plan:
    """The C++ step's description of one model (built by the lean step per snapshot), holding
    references to every tensor it points to. ``layers`` (ctypes Layer array) may be edited in
    place (the cache buffers: :meth:`set_cache`)."""

    def __init__(
        self, layers: list[Layer], final_norm: Norm, head: Lin, d_model: int, rope: bool,
        builder: Builder,
    ) -> None:  # fmt: skip
        self.keep = builder.keep
        self.layers = (Layer * len(layers))(*layers)
        self.model = Model(len(layers), d_model, head.n, int(rope), int(SPLIT_QUANTIZED),
                           self.layers, final_norm, head)  # fmt: skip
        self.vocab = int(head.n)
        self.rope = rope
        # (cos, sin) (P, hd) float32 for positions 0..P-1 (the caller's table), or None
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.d_model = d_model
        self.bufs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layers)

    def set_cache(self, i: int, kbuf: torch.Tensor, vbuf: torch.Tensor) -> None:
        """Point layer ``i`` at its key / value buffers (B, KV, capacity, hd) float32 CPU, last
        stride 1 (checked by the caller)."""
        lay = self.layers[i]
        lay.kbuf, lay.vbuf = kbuf.data_ptr(), vbuf.data_ptr()
        for j in range(3):
            lay.ks[j], lay.vs[j] = kbuf.stride(j), vbuf.stride(j)
        lay.capacity = min(kbuf.shape[2], vbuf.shape[2])
        self.bufs[i] = (kbuf, vbuf)

    def run(
        self, x: torch.Tensor, s: int, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, D) contiguous float32 (overwritten) at position ``s`` -> logits (B, V); cos,
        sin (hd,) contiguous float32 (None: no rotation). The cache buffers get slot ``s``.
        Raises RuntimeError when the C++ side refuses (the caller checked what it can)."""
        lib = _lib.lib
        assert lib is not None
        b = x.shape[0]
        logits = torch.empty(b, self.vocab)
        rc = lib.lmlab_decode_step(
            ctypes.byref(self.model), x.data_ptr(), b, s,
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
            logits.data_ptr(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"lmlab's decode step refused its plan (code {rc})")
        return logits
