"""lmlab's CPU kernels for training: passes torch's eager graph makes separately, made once.

**Bias + GELU** (:func:`bias_gelu`). Legend: R rows (batch x tokens, any leading dims
flattened), F the layer's outputs (d_ff). :func:`bias_gelu` computes ``gelu(h + b)`` from ``h``
(..., F), a matmul's output WITHOUT its bias, and ``b`` (F,) or None; its backward
(:class:`BiasGeluFunction`) gives ``dh = g * gelu'(h + b)`` and the bias gradient ``db`` (the
column sums of dh, in float32) in the same pass. Torch's eager graph for ``gelu(F.linear(x, W,
b))`` makes five passes over the (R, F) tensor for these (addmm's bias broadcast into its
output and the GEMM's read of it, gelu, gelu_backward, the bias gradient's column sum); here
the matmul runs bias-free (``F.linear(x, W)``) and the rest is one pass each way. GELU is exact
(``approximate="none"``, Hendrycks & Gimpel 2016) or GPT-2's tanh form (``"tanh"``).

**Causal softmax** (:func:`causal_softmax_`, used by
:func:`lmlab.nn.attention_core.causal_attention_bmm` in bf16 training). Legend: N batch x
heads, T tokens. Scores S (N, T, T) -> P, P[n, i, j] the softmax over j <= i of row i for j <=
i and 0 above the diagonal, in one pass over the lower triangle (torch: masked_fill of -inf
above the diagonal, then softmax over whole rows: two passes over all T^2 entries); its
backward dS = P (dP - rowsum(P dP)) likewise over the lower triangle only, both in place.

Neither is bit-equal to torch: float32 arithmetic with their own erf and exp fits (within
about 1e-6 of the float64 formulas, see ``train_kernels.cpp``), then one rounding to the
tensor's dtype; the bias is added to the bfloat16 matmul output in float32 (torch rounds the
biased output to bfloat16, then GELU's). Training uses them for bfloat16 activations only
(autocast's, ``train.precision`` bf16 or auto on a CPU with bf16): a float32 run keeps torch's
ops and their bits.

Both are in ``train_kernels.cpp``, compiled on first use by :func:`lmlab.nn.cpp_build.build`
(a few seconds once, then a cached load) and called through ctypes with the tensors' data
pointers, as :mod:`lmlab.nn.rope_kernel` is. When it cannot be used (``LMLAB_NO_CPP_KERNELS=1``,
no C++ compiler, a failed build) :func:`available` is False, the reason is in :func:`status`,
and training runs torch's ops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmlab.nn import cpp_build

SOURCE = Path(__file__).with_name("train_kernels.cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
APPROXIMATIONS = ("none", "tanh")  # F.gelu's ``approximate`` values the kernel computes


def _build() -> ctypes.CDLL:
    """Compile (or load from the cache) train_kernels.cpp; raises on any failure."""
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
    avx512 = cpp_build.cpu_has_avx2_fma() and cpp_build.cpu_has_avx512f()
    avx512bw = avx512 and {"avx512bw", "avx512vl", "avx512dq"} <= cpp_build.cpu_flags()
    bf16 = avx512bw and "avx512_bf16" in cpp_build.cpu_flags()
    if avx512bw:
        flags += ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    flags += ["-mavx512bf16"] if bf16 else []
    kind = "avx512bf16" if bf16 else "avx512" if avx512bw else "generic"
    path = cpp_build.build(f"lmlab_train_kernels_{kind}", [str(SOURCE)], flags, ["-fopenmp"])
    lib = ctypes.CDLL(str(path))
    i64, fp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.lmlab_bias_gelu_forward.argtypes = [ci, ci, fp, fp, fp, i64, i64, ci]
    lib.lmlab_bias_gelu_forward.restype = ci
    lib.lmlab_bias_gelu_backward.argtypes = [ci, ci, fp, fp, fp, fp, fp, i64, i64, ci]
    lib.lmlab_bias_gelu_backward.restype = ci
    lib.lmlab_causal_softmax_forward.argtypes = [ci, fp, fp, i64, i64]
    lib.lmlab_causal_softmax_forward.restype = ci
    lib.lmlab_causal_softmax_backward.argtypes = [ci, fp, fp, fp, i64, i64]
    lib.lmlab_causal_softmax_backward.restype = ci
    return lib


_kernel = cpp_build.LazyLibrary(lambda: _build(), lambda lib: "compiled")


def available() -> bool:
    """Whether the compiled kernel can be used (compiles it on the first call); False inside
    :func:`disabled`."""
    return _kernel.available()


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block training runs torch's ops instead (A/B benchmarks, tests)."""
    with _kernel.disabled():
        yield


def status() -> str:
    """``compiled``, or why the kernel is not used (``not loaded yet`` before the first use)."""
    return _kernel.status()


def _refusal(h: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why :func:`bias_gelu` cannot take h and ``bias`` (None: it can, the kernel aside)."""
    if h.device.type != "cpu" or h.dtype not in _DTYPES:
        return f"h must be a float32 or bfloat16 CPU tensor, not {h.dtype} on {h.device}"
    if h.dim() < 1 or h.shape[-1] < 1:
        return f"h must have a last dim of at least 1, not shape {tuple(h.shape)}"
    if bias is not None:
        if bias.device.type != "cpu" or bias.dtype not in (torch.float32, h.dtype):
            return (
                f"bias must be float32 or h's dtype on the CPU, not {bias.dtype} on {bias.device}"
            )
        if bias.shape != h.shape[-1:]:
            return f"bias must have shape {tuple(h.shape[-1:])}, not {tuple(bias.shape)}"
    return None


def applies(h: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`bias_gelu` takes h (..., F) and ``bias`` (F,) or None: CPU tensors, h
    float32 or bfloat16, the bias float32 or h's dtype, F >= 1, and the kernel available."""
    return _refusal(h, bias) is None and available()


def _lib() -> ctypes.CDLL:
    lib = _kernel.load()
    if lib is None:
        raise RuntimeError(f"lmlab's training kernels are not available: {status()}")
    return lib


def _codes(h: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    return _DTYPES[h.dtype], 0 if bias is None or bias.dtype == torch.float32 else 1


class BiasGeluFunction(torch.autograd.Function):
    """y = gelu(h + b) (h (..., F), b (F,) or None; y h's shape and dtype), backward dh (h's
    dtype) and db (b's dtype, summed in float32), each one kernel pass. Saves h and b (what
    torch's graph saves for its GELU: one (..., F) tensor)."""

    @staticmethod
    def forward(ctx, h, bias, approximate):
        h = h.contiguous()
        b = None if bias is None else bias.detach().contiguous()
        y = torch.empty_like(h)
        f = h.shape[-1]
        dt, bt = _codes(h, b)
        rc = _lib().lmlab_bias_gelu_forward(
            dt, bt, h.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
            h.numel() // f, f, int(approximate == "tanh"),
        )  # fmt: skip
        if rc:
            raise ValueError(f"the GELU kernel refused dtypes {h.dtype}, {b.dtype}")  # type: ignore[union-attr]
        ctx.save_for_backward(h, b)
        ctx.approximate = approximate
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        h, b = ctx.saved_tensors
        g = g.to(h.dtype).contiguous()
        f = h.shape[-1]
        dh = torch.empty_like(h)
        want_db = b is not None and ctx.needs_input_grad[1]
        db = torch.empty(f, dtype=torch.float32) if want_db else None
        dt, bt = _codes(h, b)
        _lib().lmlab_bias_gelu_backward(
            dt, bt, g.data_ptr(), h.data_ptr(), None if b is None else b.data_ptr(),
            dh.data_ptr(), None if db is None else db.data_ptr(), h.numel() // f, f,
            int(ctx.approximate == "tanh"),
        )  # fmt: skip
        if db is not None and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        return dh, db, None


def bias_gelu(
    h: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """gelu(h + bias): h (..., F) float32 or bfloat16 on a CPU (a bias-free matmul's output),
    bias (F,) float32 or h's dtype, or None; ``approximate`` "none" (exact) or "tanh".
    Differentiable in h and bias (:class:`BiasGeluFunction`). Raises RuntimeError when the
    kernel is unavailable and ValueError for an approximation it does not compute (check
    :func:`applies` first)."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, not {approximate!r}")
    why = _refusal(h, bias)
    if why is not None:  # checked before any pointer reaches the kernel
        raise ValueError(f"bias_gelu: {why}")
    return BiasGeluFunction.apply(h, bias, approximate)


def _scores_ok(scores: torch.Tensor) -> bool:
    """A contiguous (N, T, T) float32 or bfloat16 CPU tensor."""
    return (
        scores.device.type == "cpu"
        and scores.dtype in _DTYPES
        and scores.dim() == 3
        and scores.shape[1] == scores.shape[2]
        and scores.is_contiguous()
    )


def causal_softmax_applies(scores: torch.Tensor) -> bool:
    """Whether :func:`causal_softmax_` takes ``scores``: a contiguous (N, T, T) float32 or
    bfloat16 CPU tensor, and the kernel available."""
    return _scores_ok(scores) and available()


def causal_softmax_(scores: torch.Tensor) -> torch.Tensor:
    """In place: scores (N, T, T) -> P, softmax over j <= i of each row i, 0 above the
    diagonal (what ``masked_fill(above, -inf)`` then ``softmax(-1)`` give, to one rounding of
    the scores' dtype). No autograd (the caller's Function saves P and calls
    :func:`causal_softmax_backward_`). Returns ``scores``."""
    if not _scores_ok(scores):
        raise ValueError(
            f"causal_softmax_: scores must be a contiguous (N, T, T) float32 or bfloat16 CPU "
            f"tensor, not {scores.dtype} {tuple(scores.shape)} on {scores.device}"
        )
    n, t, _ = scores.shape
    _lib().lmlab_causal_softmax_forward(
        _DTYPES[scores.dtype], scores.data_ptr(), scores.data_ptr(), n, t
    )
    return scores


def causal_softmax_backward_(probs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """In place on ``grad`` (dP, (N, T, T), contiguous, probs' dtype): dS = P (dP - rowsum(P dP))
    over j <= i, 0 above the diagonal; softmax's backward for :func:`causal_softmax_`'s P.
    Returns ``grad``."""
    n, t, _ = probs.shape if probs.dim() == 3 else (0, 0, 0)
    if not _scores_ok(probs) or grad.device.type != "cpu":
        raise ValueError(
            "causal_softmax_backward_: probs must be a contiguous (N, T, T) CPU tensor"
        )
    if grad.shape != probs.shape or grad.dtype != probs.dtype or not grad.is_contiguous():
        raise ValueError(
            "causal_softmax_backward_: grad must be contiguous, of probs' shape and dtype"
        )
    _lib().lmlab_causal_softmax_backward(
        _DTYPES[probs.dtype], probs.data_ptr(), grad.data_ptr(), grad.data_ptr(), n, t
    )
    return grad
