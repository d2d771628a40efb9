"""lmlab's CPU kernels for training: passes torch's eager graph makes separately, made once.

**Causal softmax** (:func:`causal_softmax_`; in bf16 training
:func:`lmlab.nn.attention_core.causal_attention_bmm` calls the same kernel from its C++
operator). Legend: N batch x
heads, T tokens. Scores S (N, T, T) -> P, P[n, i, j] the softmax over j <= i of row i for j <=
i and 0 above the diagonal, in one pass over the lower triangle (torch: masked_fill of -inf
above the diagonal, then softmax over whole rows: two passes over all T^2 entries); its
backward dS = P (dP - rowsum(P dP)) likewise over the lower triangle only, both in place.

Not bit-equal to torch: float32 arithmetic with its own exp fit (a few float32 ulps of the
float64 formula, see ``train_kernels.cpp``), then one rounding to the scores' dtype. Training
uses it for bfloat16 scores only (the batched-matmul attention path): a float32 run keeps
torch's ops and their bits.

**Fused causal attention** (``torch.ops.lmlab.causal_attention_bf16``, ``attention_kernels.cpp``,
built into the same library where the CPU has AVX512-BF16: :func:`attention_bf16_available`;
bf16 training takes it through :func:`lmlab.nn.attention_core.causal_attention_train`): the
attention of one (batch, head) at a time in cache, forward and backward, with bf16 dot products
summed in float32, multiplying only the blocks on or below the diagonal (about half of what
the six full batched matmuls of the forward and backward multiply) and keeping P for the
backward in row pairs.

**Gradient clipping** (:func:`clip_grads_`, ``torch.ops.lmlab.clip_grads_``, used by
:func:`lmlab.training.guard.clip_gradients` for plain float32 CPU gradients): the global L2 norm
in one threaded float64 pass and, only when the coefficient is below 1, one scaling pass; one
call, which checks the tensors itself, in place of torch's per-tensor norms, their stack and
norm, and a multiply by 1 when nothing is clipped.

**AdamW's step** (``torch.ops.lmlab.adamw_step_``, used by :class:`lmlab.training.optim.AdamW`,
the trainer's AdamW): every parameter's update in one call and one threaded pass, the same
bits as torch's ``AdamW(fused=True)`` on an AVX-512 CPU, which opens a parallel region per
parameter and counts the steps tensor by tensor.

**Norms straight to bf16** (:func:`norm_bf16`, :func:`norm_bf16_op`), the **residual add**
of a bf16 branch to the float32 stream (:func:`residual_add`, with a residual projection's
float32 bias where :func:`residual_bias_applies`), an MLP's **bias + GELU** (:func:`gelu_up`)
and a gated FFN's **silu(gate) * up** (:func:`silu_mul`), see their docstrings.

In ``train_kernels.cpp``, compiled on first use by :func:`lmlab.nn.cpp_build.build` (some
seconds once, then a cached load) together with ``train_ops.cpp``, which registers torch
operators with their autograd in C++ (``torch.ops.lmlab.norm_bf16``, ``causal_attention_bmm``,
``add_f32_bf16``, ``causal_attention_bf16``, ``gelu_bf16``, ``silu_mul_bf16``,
``adamw_step_``): the training path enters the kernels through them, without a Python
``autograd.Function`` (20-50 us a call each way). The functions here that take tensors
directly (the causal softmax, clipping) call the kernels through ctypes with the tensors' data
pointers, as :mod:`lmlab.nn.rope_kernel` does. When the
library cannot be used (``LMLAB_NO_CPP_KERNELS=1``, no C++ compiler, a failed build)
:func:`available` is False, the reason is in :func:`status`, and training runs torch's ops.

A GELU kernel whose forward also kept the derivative (so the backward is one multiply) and a
bf16 linear operator with the bias inside oneDNN's matmul were built in the fifth session and
measured 1.007x and 1.00x of the step; neither was kept (benchmarks/README.md, "Fifth pass").

**GELU of the MLP's up projection** (:func:`gelu_up`, ``torch.ops.lmlab.gelu_bf16``): in bf16
autocast training the up projection runs without its bias (``mm``, not ``addmm``) and one
pass computes the GELU (exact, or its tanh form) of its output plus the float32 bias; the
backward is one pass too, GELU's gradient and the bias gradient's column sums together. A
fourth-session kernel of this kind measured 1.00x on the Xeon of the time and was removed;
rebuilt in the tenth session with torch's own erf formula and one exponential each way, it
measured 1.02-1.05x of the Mini-GPT bf16 step on the Zen 4 (benchmarks/README.md, "tenth
session").
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lmlab.nn import cpp_build

SOURCE = Path(__file__).with_name("train_kernels.cpp")
# the operators torch.ops.lmlab.* (norm_bf16, causal_attention_bmm, add_f32_bf16, gelu_bf16,
# silu_mul_bf16), their autograd in C++
OPS_SOURCE = Path(__file__).with_name("train_ops.cpp")
# the fused bf16 causal attention (torch.ops.lmlab.causal_attention_bf16; AVX512-BF16 builds)
ATTENTION_SOURCE = Path(__file__).with_name("attention_kernels.cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.lru_cache(maxsize=1)
def _build_kind() -> str:
    """The instruction set the library is built for here: "avx512bf16" (AVX-512 F, BW, VL, DQ
    and AVX512-BF16: the fused attention too), "avx512" or "generic" (read once: the memory
    estimate asks for every attention layer)."""
    avx512 = cpp_build.cpu_has_avx2_fma() and cpp_build.cpu_has_avx512f()
    avx512bw = avx512 and {"avx512bw", "avx512vl", "avx512dq"} <= cpp_build.cpu_flags()
    bf16 = avx512bw and "avx512_bf16" in cpp_build.cpu_flags()
    return "avx512bf16" if bf16 else "avx512" if avx512bw else "generic"


def _build() -> ctypes.CDLL:
    """Compile (or load from the cache) train_kernels.cpp, train_ops.cpp and
    attention_kernels.cpp into one library, which registers the operators torch.ops.lmlab.*;
    raises on any failure."""
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
    kind = _build_kind()
    if kind != "generic":
        flags += ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    flags += ["-mavx512bf16"] if kind == "avx512bf16" else []
    sources = [str(SOURCE), str(OPS_SOURCE), str(ATTENTION_SOURCE)]
    path = cpp_build.build(f"lmlab_train_kernels_{kind}", sources, flags, ["-fopenmp"])
    if not hasattr(torch.ops.lmlab, "norm_bf16"):  # registered when the library was loaded
        raise RuntimeError(f"{path} did not register torch.ops.lmlab.norm_bf16")
    lib = ctypes.CDLL(str(path))
    i64, fp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.lmlab_causal_softmax_forward.argtypes = [ci, fp, fp, i64, i64]
    lib.lmlab_causal_softmax_forward.restype = ci
    lib.lmlab_causal_softmax_backward.argtypes = [ci, fp, fp, fp, i64, i64]
    lib.lmlab_causal_softmax_backward.restype = ci
    f32 = ctypes.c_float
    lib.lmlab_norm_bf16_forward.argtypes = [ci, fp, fp, fp, fp, fp, fp, i64, i64, f32]
    lib.lmlab_norm_bf16_forward.restype = ci
    lib.lmlab_norm_bf16_backward.argtypes = [ci, fp, fp, fp, fp, fp, fp, fp, fp, i64, i64]
    lib.lmlab_norm_bf16_backward.restype = ci
    lib.lmlab_causal_attention_bf16_available.restype = ci
    lib.lmlab_gelu_bf16_blocks.argtypes = [i64]
    lib.lmlab_gelu_bf16_blocks.restype = i64
    return lib


_kernel = cpp_build.LazyLibrary(lambda: _build(), lambda lib: "compiled")


# the module's face, as the other kernel modules have it: available() (compiles on the first
# call; False inside disabled()), disabled() (a block in which training runs torch's ops: A/B
# benchmarks, tests), status() ("compiled", or why the kernels are not used)
available = _kernel.available
disabled = _kernel.disabled
status = _kernel.status


def attention_bf16_available() -> bool:
    """Whether torch.ops.lmlab.causal_attention_bf16 runs here: the kernels are
    :func:`available` and were built for a CPU with AVX512-BF16 (attention_kernels.cpp)."""
    if not available():  # inside disabled(), or not built
        return False
    lib = _kernel.load()
    return lib is not None and lib.lmlab_causal_attention_bf16_available() == 1


_AMX: list[bool] = []  # whether the CPU lists amx_bf16, read once


def attention_bf16_preferred() -> bool:
    """Whether bf16 training takes the fused attention: :func:`attention_bf16_available` on a
    CPU without AMX. Where /proc/cpuinfo lists ``amx_bf16``, oneDNN's batched matmuls run on the
    AMX tiles (the 2-core Xeon measured 1.4-1.6 TFLOP/s of bf16 matmul, against about 0.43 on
    the Zen 4 where the kernel's AVX512-BF16 dot products were measured), and the kernel has not
    been measured against them there: the batched matmuls stay."""
    if not _AMX:
        from lmlab.training.hardware import cpu_flags

        _AMX.append("amx_bf16" in cpu_flags())
    return not _AMX[0] and attention_bf16_available()


def attention_bf16_expected() -> bool:
    """What :func:`attention_bf16_preferred` will say, without compiling anything (for the
    memory estimate, which runs before training builds the kernels): the kernels not turned off
    (``LMLAB_NO_CPP_KERNELS``), to be built for AVX512-BF16, on a CPU without amx_bf16. Where
    the build then fails, training takes the batched matmuls, which keep P too; only the GQA
    count can differ (their path is torch's)."""
    from lmlab.envflags import opted_out

    if opted_out(cpp_build.ENV_OFF):
        return False
    if _kernel.tried():  # already loaded (or failed): what training will find
        return attention_bf16_preferred()
    return _build_kind() == "avx512bf16" and "amx_bf16" not in cpp_build.cpu_flags()


def traced() -> bool:
    """Whether ops are being traced or watched rather than only run: under torch.compile, or
    with a torch dispatch mode active (make_fx, FakeTensorMode, FlopCounterMode ...). The
    optimizer-side operators (clipping, AdamW's step) then leave the work to torch's ops, which
    a tracer or mode sees; the operators' own writes would be invisible to it."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def loaded() -> bool:
    """Whether the kernels' build or load has been tried in this process (then
    :func:`available` costs nothing more)."""
    return _kernel.tried()


def _lib() -> ctypes.CDLL:
    lib = _kernel.load()
    if lib is None:
        raise RuntimeError(f"lmlab's training kernels are not available: {status()}")
    return lib


def _scores_ok(scores: torch.Tensor) -> bool:
    """A contiguous (N, T, T) float32 or bfloat16 CPU tensor."""
    return (
        scores.device.type == "cpu"
        and scores.dtype in _DTYPES
        and scores.dim() == 3
        and scores.shape[1] == scores.shape[2]
        and scores.is_contiguous()
    )


def _untracked(name: str, x: torch.Tensor) -> None:
    """Raise ValueError for a tensor that records gradients: the kernel writes through its data
    pointer, outside autograd, so the tensor's graph would no longer describe its values (a
    wrong gradient, no error). Under ``no_grad`` (or inside a Function's forward) it is taken,
    and the write is counted in its version (:func:`_written`), as torch's in-place ops count
    theirs."""
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            f"{name} records gradients: the kernel writes it in place outside autograd (call "
            f"it under torch.no_grad or from a torch.autograd.Function)"
        )


def _partly_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share some memory but do not start at the same address
    (the same tensor, or the same memory, is fine: each element is read before it is written)."""
    if a.numel() == 0 or b.numel() == 0 or a.data_ptr() == b.data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _written(x: torch.Tensor) -> None:
    """Count an in-place write through the data pointer in x's version counter, so that a graph
    that saved x before raises at backward instead of using the new values."""
    torch.autograd.graph.increment_version(x)


def causal_softmax_(scores: torch.Tensor) -> torch.Tensor:
    """In place: scores (N, T, T) -> P, softmax over j <= i of each row i, 0 above the
    diagonal (what ``masked_fill(above, -inf)`` then ``softmax(-1)`` give, to one rounding of
    the scores' dtype). No autograd (the caller's Function saves P and calls
    :func:`causal_softmax_backward_`). Raises ValueError for a tensor it cannot read, or one that
    records gradients (grad mode on and ``requires_grad``: written outside autograd, its graph
    would be wrong). Returns ``scores``."""
    if not _scores_ok(scores):
        raise ValueError(
            f"causal_softmax_: scores must be a contiguous (N, T, T) float32 or bfloat16 CPU "
            f"tensor, not {scores.dtype} {tuple(scores.shape)} on {scores.device}"
        )
    _untracked("causal_softmax_: scores", scores)
    n, t, _ = scores.shape
    _lib().lmlab_causal_softmax_forward(
        _DTYPES[scores.dtype], scores.data_ptr(), scores.data_ptr(), n, t
    )
    _written(scores)
    return scores


def causal_softmax_backward_(probs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """In place on ``grad`` (dP, (N, T, T), contiguous, probs' dtype): dS = P (dP - rowsum(P dP))
    over j <= i, 0 above the diagonal; softmax's backward for :func:`causal_softmax_`'s P.
    Raises ValueError as :func:`causal_softmax_` does (for ``grad``, the tensor written), and
    for a ``grad`` that overlaps ``probs`` in part (the very same memory is fine).
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
    if _partly_overlap(probs, grad):
        raise ValueError(
            "causal_softmax_backward_: grad overlaps probs in part (rows would read values "
            "already overwritten); pass the same tensor or separate memory"
        )
    _untracked("causal_softmax_backward_: grad", grad)
    _lib().lmlab_causal_softmax_backward(
        _DTYPES[probs.dtype], probs.data_ptr(), grad.data_ptr(), grad.data_ptr(), n, t
    )
    _written(grad)
    return grad


def norm_bf16_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool
) -> torch.Tensor:
    """:func:`norm_bf16` without its checks, for callers that made them
    (:func:`lmlab.nn.norm.norm_for_matmuls`): torch.ops.lmlab.norm_bf16 (train_ops.cpp), its
    forward and backward one kernel pass each, the autograd in C++. Saves x, weight, bias and
    the per-row mean and rstd (what torch's layer_norm saves); a backward that records its own
    graph (``create_graph``, a gradient penalty) runs the norm's ATen ops instead, since the
    kernel's gradients would carry no graph and second-order terms through the norm would be
    silently missing. x float32 (..., D), weight and bias float32 (D,) contiguous, all on the
    CPU; the kernel library loaded (:func:`available`)."""
    return torch.ops.lmlab.norm_bf16(x, weight, bias, eps, rms)


def norm_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool = False,
) -> torch.Tensor:
    """LayerNorm (``rms`` False: (x - mean) / sqrt(var + eps) * weight + bias, Ba et al. 2016)
    or RMSNorm (x / sqrt(mean(x^2) + eps) * weight, Zhang & Sennrich 2019; ``bias`` must be
    None) over the last dim of x (..., D) float32, returned as bfloat16 (..., D): what autocast's
    float32 norm and the next matmul's bf16 cast give, in one pass, the float32 output never
    written. Differentiable in x, weight and bias (:func:`norm_bf16_op`; dy bfloat16 in,
    float32 gradients out). x, weight (D,) and bias (D,) float32 CPU tensors, else ValueError;
    RuntimeError when the kernel is unavailable."""
    d = x.shape[-1] if x.dim() else 0
    ok = x.device.type == "cpu" and x.dtype == torch.float32 and d >= 1
    for p in (weight, bias):
        if p is not None and (
            p.device.type != "cpu" or p.dtype != torch.float32 or p.shape != (d,)
        ):
            ok = False
    if not ok or (rms and bias is not None):
        raise ValueError(
            f"norm_bf16: x must be float32 (..., D >= 1) on the CPU with weight (and a LayerNorm's "
            f"bias) float32 (D,), not x {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if not available():
        raise RuntimeError(f"lmlab's training kernels are not available: {status()}")
    bias = None if bias is None else bias.contiguous()
    return norm_bf16_op(x, weight.contiguous(), bias, eps, rms)


def clip_grads_(grads: list[torch.Tensor], max_norm: float) -> tuple[float, float] | None:
    """Gradient clipping by the global L2 norm (Pascanu et al. 2013) of ``grads`` in place, in
    one C++ call (``torch.ops.lmlab.clip_grads_``, train_ops.cpp): the norm from the sum of
    squares accumulated in float64 in one threaded pass over fixed blocks (the same value for any
    thread count; torch's ``get_total_norm``, per-tensor float32 norms then their norm, agrees to
    a few float32 roundings; a sum of squares past float32's range is an inf norm, as torch's
    is, except for a lone one-element gradient, whose float32 norm torch takes as its absolute
    value, and within a few 1e-8 of the limit, where the two round differently); then, when
    the norm is finite and ``max_norm`` > 0, the coefficient min(max_norm / (norm + 1e-6), 1)
    in float32 as torch's ``clip_grads_with_norm_`` computes it, and only when it is below 1 a
    second pass multiplying every element by it (torch's float32 products; each tensor's
    version counted). Returns (norm, the coefficient applied: 1.0 for none); a NaN or inf norm
    scales nothing. None, with nothing read or written, where the kernel cannot take the
    tensors: not all contiguous float32 CPU tensors with their own memory (two sharing memory
    would be counted, and scaled, twice), an inference tensor, a tensor subclass with its own
    dispatch, or one that records gradients while grad mode is on. Raises RuntimeError when the
    kernels are unavailable."""
    _lib()
    taken, norm, coef = torch.ops.lmlab.clip_grads_(grads, float(max_norm))
    return (norm, coef) if taken else None


def cpu_bf16_training(x: torch.Tensor) -> bool:
    """Whether ``x`` is on the CPU while gradients are recorded under CPU bf16 autocast, not
    under torch.compile: where the training operators below may apply."""
    if not (torch.is_grad_enabled() and x.is_cpu) or torch.compiler.is_compiling():
        return False
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16


# The residual add of a bf16 branch to the float32 stream in one pass (torch.ops.lmlab.
# add_f32_bf16); False: torch's x + y (A/B benchmarks).
TRAIN_ADD_KERNEL = True


def residual_add(
    x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x + y`` (``bias``: ``x + (y + bias)``, bias (N,) broadcast over y (..., N)). For a
    float32 x and a bfloat16 y of the same shape, both contiguous on the CPU, while gradients
    are recorded (bf16 autocast training: the residual stream and a branch's output):
    torch.ops.lmlab.add_f32_bf16, one pass, the same bits as torch's x + y (torch widens y into
    a float32 temporary first, then adds: 0.5 ms of a 1 ms add at the Mini-GPT shape); its
    backward is add's (g to x, g cast to bfloat16 to y). With a float32 ``bias`` (a residual
    projection's, which then runs bias-free: :func:`residual_bias_applies`) y + bias is added in
    float32 in the same pass, and the backward's one pass also sums the bias gradient's float32
    columns (fixed row blocks: the same bits for any thread count); torch's path (addmm, then
    the add) rounds y + bias to bfloat16 and sums the bfloat16 gradient into a bfloat16 bias
    gradient (one rounding), then casts it."""
    if (
        TRAIN_ADD_KERNEL
        and x.dtype is torch.float32
        and y.dtype is torch.bfloat16
        and torch.is_grad_enabled()
        and x.is_cpu
        and y.is_cpu
        and x.shape == y.shape
        and x.is_contiguous()
        and y.is_contiguous()
        and not torch.compiler.is_compiling()
        and available()
    ):
        return torch.ops.lmlab.add_f32_bf16(x, y, bias)
    return x + y if bias is None else x + (y + bias)


# A residual projection's bias added by the residual add (residual_add's bias; ffn.residual_parts)
# instead of by the projection's addmm; False: the biased projection, then the add (A/B benchmarks).
TRAIN_RESIDUAL_BIAS = True


def residual_bias_applies(weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether a residual projection (``weight`` (D, F), ``bias`` (D,)) should run bias-free and
    leave its bias to :func:`residual_add` (whose caller checks that the stream is float32): in
    bf16 autocast CPU training (gradients recorded, not under torch.compile), float32 CPU
    parameters, no global module hooks, :data:`TRAIN_RESIDUAL_BIAS` and
    :data:`TRAIN_ADD_KERNEL` on and the kernels built."""
    if not (TRAIN_RESIDUAL_BIAS and TRAIN_ADD_KERNEL and cpu_bf16_training(weight)):
        return False
    if weight.dtype is not torch.float32 or bias.dtype is not torch.float32 or bias.dim() != 1:
        return False
    if not (weight.is_cpu and bias.is_cpu):
        return False
    from lmlab.nn.fused import global_hooks

    return not global_hooks() and available()


# The MLP's GELU (exact or tanh form) of its bias-free bf16 up projection plus the float32 bias,
# one pass each way (torch.ops.lmlab.gelu_bf16); False: torch's addmm and gelu (A/B benchmarks).
TRAIN_GELU_KERNEL = True


def gelu_up(x: torch.Tensor, up: torch.nn.Module, tanh: bool = False) -> torch.Tensor | None:
    """``F.gelu(up(x))`` (the exact erf GELU; ``tanh``: ``approximate="tanh"``, GPT-2's
    ``gelu_new``) for an MLP's up projection ``up`` (a plain
    :class:`torch.nn.Linear`, weight (F, D), bias (F,) or None) and input x (..., D), or None
    where this path does not apply (the caller runs ``up`` and ``F.gelu``).

    It applies in bf16 autocast CPU training (gradients recorded, autocast on for the CPU in
    bfloat16, float32 parameters, not under torch.compile) with the kernels :func:`available`
    and built for AVX-512: the projection runs bias-free under autocast (a bf16 ``mm`` instead of
    ``addmm``, which first writes the bias broadcast into its output), then
    ``torch.ops.lmlab.gelu_bf16`` computes gelu(u + bias) in float32 from the bf16 product u and
    the float32 bias in one pass, rounding once to bf16; its backward is one pass: GELU's
    gradient (rounded to bf16) and the bias gradient (float32 column sums of that gradient
    before its rounding, the same bits for any thread count). Against torch's path the bias is
    not rounded to bf16 first and z = u + bias is not rounded before the GELU: values agree to
    bf16 rounding, not bit for bit. Torch's own
    erf formula (Abramowitz & Stegun 7.1.26, absolute error 1.5e-7); the tanh form's tanh from
    one exponential. A backward that records its graph (create_graph) runs the same formula as
    ATen ops."""
    if not (TRAIN_GELU_KERNEL and cpu_bf16_training(x)):
        return None
    weight, bias = up._parameters.get("weight"), up._parameters.get("bias")
    if weight is None or weight.dtype is not torch.float32 or not weight.is_cpu:
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu or bias.dim() != 1):
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or _build_kind() == "generic":
        return None
    if not available():
        return None
    u = torch.nn.functional.linear(x, weight)  # autocast: bf16 (..., F)
    if u.dtype is not torch.bfloat16:
        return None  # pragma: no cover - autocast in bf16 casts it so
    return torch.ops.lmlab.gelu_bf16(u, bias, tanh)


# A SwiGLU FFN's silu(gate) * up in one pass each way (torch.ops.lmlab.silu_mul_bf16); False:
# torch's silu and multiply (A/B benchmarks).
TRAIN_SILU_KERNEL = True


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for a gated FFN's two bf16 projections gate and up (..., F), or None
    where this path does not apply (the caller runs torch's ops).

    It applies in bf16 autocast CPU training (gradients recorded, autocast on for the CPU in
    bfloat16, not under torch.compile) to bfloat16 gate and up of one shape, with the kernels
    :func:`available` and built for AVX-512: ``torch.ops.lmlab.silu_mul_bf16`` computes
    silu(gate) up in float32 and rounds once (torch rounds silu(gate) to bf16 first, then the
    product), keeping gate and up for its backward, which is one pass (both gradients, each
    rounded once) where torch's takes three and keeps silu(gate) as well. Values agree with
    torch's path to bf16 rounding, not bit for bit. A backward that records its graph
    (create_graph) runs the formula as ATen ops."""
    if not (TRAIN_SILU_KERNEL and cpu_bf16_training(gate)):
        return None
    if gate.dtype is not torch.bfloat16 or up.dtype is not torch.bfloat16:
        return None
    if gate.shape != up.shape or not up.is_cpu or _build_kind() == "generic":
        return None
    if not available():
        return None
    return torch.ops.lmlab.silu_mul_bf16(gate, up)


def silu_mul_expected() -> bool:
    """Whether bf16 CPU training will take :func:`silu_mul`, without compiling anything (for
    the memory estimate: one F tensor fewer kept per gated FFN): the flag on, the kernels not
    turned off (``LMLAB_NO_CPP_KERNELS``), to be built for AVX-512 (or already loaded)."""
    from lmlab.envflags import opted_out

    if not TRAIN_SILU_KERNEL or opted_out(cpp_build.ENV_OFF):
        return False
    if _kernel.tried():
        return available() and _build_kind() != "generic"
    return _build_kind() != "generic"
