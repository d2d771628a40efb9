"""Run-time fast paths for inference: plain linears called without the module machinery, and
several linears reading the same input fused into one matmul (q/k/v, gate/up), float32 ones on
the CPU through oneDNN's matmul (:func:`dense`).

Legend: B batch, T tokens, D in features, N out features. The parameters and their names stay
as they are (``q_proj.weight`` ...): what is fused is a cached concatenation of their weights,
built only with gradients off (``torch.no_grad`` / ``inference_mode``, the decode loop and
evaluation) and rebuilt on its next use after any of these:

- a source parameter is a new tensor (``load_state_dict(..., assign=True)``, ``.to()``, a new
  tensor assigned to ``.data``): its identity or address differs;
- a source parameter was updated in place by an op that bumps its version counter
  (``load_state_dict``'s copy, ``torch.nn.init``, ``p.mul_()`` under ``no_grad``);
- any ``torch.optim`` optimizer stepped, anywhere in the process (a global step hook). This is
  needed because the fused optimizer kernels (``AdamW(fused=True)``, which lmlab's trainer
  uses, ``Adam``/``SGD(fused=True)``) write the parameters without bumping their version
  counter: the copy built by one evaluation went stale by the next one (issue 14);
- a forward of a fusable module ran with gradients on (a training forward), which covers a
  hand-written update loop (``p.data -= lr * p.grad``) that no counter sees.

Caveat: an in-place write that bumps no version counter (through ``param.data``, a fused kernel
called directly, a collective) made outside an optimizer step, with no gradient-enabled forward
since the last no_grad one, is not seen; nor is a training forward under ``torch.compile``
(the compiled graph skips this module's Python; its optimizer step still counts). Call
:func:`drop_fused` on the model after such a write. The price of the global rules is a rebuild
(one copy of the fused weights) on the first no_grad forward after any optimizer step or
training forward in the process; a decode loop does neither.

Only exact ``nn.Linear`` modules with no torch hooks take these paths (a quantized layer,
a parametrized one or one with a forward hook is called as a module), so nothing a user hooked
or replaced is bypassed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from torch.optim.optimizer import register_optimizer_step_post_hook

from lmlab.envflags import opted_out


def global_hooks() -> bool:
    """Whether any global module hook (``register_module_forward_hook`` ...) is registered."""
    return bool(
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


def torch_hooks(m: nn.Module) -> bool:
    """Whether ``m`` itself has a torch hook (forward, forward pre-, backward or backward pre-
    hook); global module hooks are :func:`global_hooks`."""
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


def hooked_within(m: nn.Module) -> bool:
    """Whether ``m`` or a module inside it has a torch hook of its own (:func:`torch_hooks`):
    a walk over ``_modules`` by hand (``m.modules()`` builds names and a memo set, several
    times slower, and a training step asks this every layer)."""
    return torch_hooks(m) or any(c is not None and hooked_within(c) for c in m._modules.values())


def plain_linear(m: nn.Module) -> bool:
    """Whether ``m`` is an exact ``nn.Linear`` with no torch hooks of its own whose weight and
    bias are its registered parameters (so calling ``F.linear`` on them is what calling it
    does; a weight deleted and set again as a plain attribute is not in ``_parameters``)."""
    p = m._parameters
    return (
        type(m) is nn.Linear and not torch_hooks(m) and p.get("weight") is not None and "bias" in p
    )


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``: x (..., D) -> (..., N), through :func:`dense` directly when ``m`` is a plain
    linear (:func:`plain_linear`; no global module hooks), which skips the microseconds of
    ``nn.Module.__call__`` (a decode step makes hundreds of these calls)."""
    if plain_linear(m) and not global_hooks():
        p = m._parameters  # the dict itself: no nn.Module.__getattr__ per parameter
        return dense(x, p["weight"], p["bias"])  # type: ignore[arg-type]
    return m(x)


OPT_OUT_ENV = "LMLAB_NO_ONEDNN"


def onednn_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``LMLAB_NO_ONEDNN`` (in ``environ``, default ``os.environ``) leaves the oneDNN
    path on: unset or one of :data:`lmlab.envflags.OFF_VALUES`; any other value turns it off."""
    return not opted_out(OPT_OUT_ENV, environ)


# Float32 CPU inference linears through oneDNN (:func:`dense`): on unless ``LMLAB_NO_ONEDNN=1``
# was set when lmlab was imported; False sends them to ``F.linear`` (A/B runs:
# ``benchmarks/smollm2_decode.py --linear-ab``).
ONEDNN = onednn_wanted()
# Products of fewer multiply-adds than this stay with F.linear: oneDNN's call costs about 13 us
# more (measured on the Zen 4: 0.15-0.8x F.linear's speed below 10^6 multiply-adds, 1.06-2.2x
# from 4 x 10^6 up to SmolLM2's head; benchmarks/README.md, "oneDNN for float32 inference").
ONEDNN_MIN_MACS = 1 << 22
_onednn_op: object | None = None  # torch.ops.mkldnn._linear_pointwise, or False: absent


def _onednn() -> object | None:
    """oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler
    emits for CPU linears), or None in a torch built without oneDNN."""
    global _onednn_op
    if _onednn_op is None:
        ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        _onednn_op = torch.ops.mkldnn._linear_pointwise.default if ok else False
    return _onednn_op or None


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K) -> (..., N) with weight (N, K), bias (N,).

    With gradients off, float32 on the CPU, it runs through oneDNN's matmul instead of
    ``F.linear``'s BLAS call (MKL's sgemm in torch's x86 wheels): the same product summed in
    another order (about 1e-6 relative), measured 1.07-1.24x faster on a 2-core AMD EPYC (Zen 4)
    at a 128-token prefill's shapes and 1.7-2.0x at one row for weights of 1.8M elements and up,
    where MKL reads the weight at half the memory bandwidth (``benchmarks/README.md``, "oneDNN
    for float32 inference"). Only for products of at least :data:`ONEDNN_MIN_MACS`
    multiply-adds (oneDNN's call costs more than small products gain), only for plain
    dense tensors (strided, not nested, no subclass), a contiguous weight and bias, rows to
    multiply, and nothing that transforms or records the call: no autocast, torch function or
    dispatch mode (FLOP counters, fake tensors), forward-mode AD or ``torch.func`` transform,
    ``torch.compile``/``torch.jit`` trace, nor ``torch.backends.mkldnn.flags(enabled=False)``.
    Anything else, a torch without oneDNN and ``LMLAB_NO_ONEDNN=1`` take ``F.linear``."""
    if (
        ONEDNN
        and not torch.is_grad_enabled()  # training leaves here, after one check
        and not torch.compiler.is_compiling()  # before the rest: dynamo cannot trace them
        and not torch.jit.is_tracing()  # nor can the tracer (shapes read as constants)
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.layout is torch.strided
        and weight.layout is torch.strided
        and not x.is_nested
        and weight.dim() == 2
        and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS  # rows x N x K (x.numel() = rows K)
        and x.numel() > 0
        and x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() >= 2
        and x.shape[-1] == weight.shape[1]
        and weight.is_contiguous()
        and (bias is None or _plain_bias(bias, weight))
        and not torch.is_autocast_enabled("cpu")
        and not torch._C._len_torch_function_stack()
        and not torch._C._len_torch_dispatch_stack()
        and torch._C._functorch.peek_interpreter_stack() is None  # vmap, jvp, grad, jacfwd
        and torch.autograd.forward_ad._current_level < 0  # dual tensors (no forward AD formula)
        and torch._C._get_mkldnn_enabled()  # torch.backends.mkldnn.flags(enabled=False)
    ):
        op = _onednn()
        if op is not None:
            return op(x, weight, bias, "none", [], "")  # type: ignore[operator]
    return F.linear(x, weight, bias)


def _plain_bias(bias: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        type(bias) in (torch.Tensor, nn.Parameter)
        and bias.layout is torch.strided
        and bias.dtype is torch.float32
        and bias.device.type == "cpu"
        and bias.shape == weight.shape[:1]
        and bias.is_contiguous()  # oneDNN reads the bias densely: a strided view gave wrong sums
    )


# On by default; False turns the fused path off (A/B runs, or to save the memory of the copies).
ENABLED = True

# Bumped by every torch.optim step (a global hook, registered with the first fused copy) and by
# every gradient-enabled forward of a fusable module; a fused copy built at another value of it
# is stale (see the module docstring).
_generation = 0
_step_hook: object | None = None


def _bump(*_: object) -> None:
    """Make every fused copy stale (its next use rebuilds it)."""
    global _generation
    _generation += 1


def training_forward() -> None:
    """Note a gradient-enabled forward of a fusable module that does not pass through
    :func:`fused_weights` (lmlab.nn.attention.SoftmaxAttention.fused_rope_attention): every
    fused copy goes stale, as one made by such a forward does (the module docstring)."""
    _bump()


def _watch_optimizers() -> None:
    """Register :func:`_bump` as a global ``torch.optim`` step post-hook, once."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_bump)


class _Fused:
    """One fused weight (sum N, D) and bias (sum N,) or None, with what it was built from: the
    modules, their parameters, an alias of each one's data (which keeps its memory alive, so a
    new tensor cannot take its address), its version and the generation (:data:`_generation`)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        _watch_optimizers()
        self.generation = _generation  # read before the copy: a step during it makes it stale
        self.modules = modules
        self.params = [m._parameters[n] for m in modules for n in ("weight", "bias")]
        self.data = [p.data if p is not None else None for p in self.params]
        self.versions = [p._version if p is not None else 0 for p in self.params]
        weights: list[torch.Tensor] = [p for p in self.params[::2] if p is not None]
        biases: list[torch.Tensor] = [p for p in self.params[1::2] if p is not None]
        self.weight = torch.cat(weights, dim=0)
        self.bias = torch.cat(biases, dim=0) if biases else None

    def fresh(self, modules: list[nn.Module]) -> bool:
        """Whether ``modules`` are the very plain linears this was built from, holding the very
        parameter tensors, unchanged since (same version, same memory, no optimizer step or
        training forward since)."""
        if self.generation != _generation:
            return False
        i = 0
        for m, was in zip(modules, self.modules, strict=True):
            if m is not was or not plain_linear(m):
                return False
            for n in ("weight", "bias"):
                p, d = m._parameters[n], self.data[i]
                if p is not self.params[i] or (p is not None and p.is_inference()):
                    return False
                changed = p is not None and d is not None and p._version != self.versions[i]
                if changed or (p is not None and d is not None and p.data_ptr() != d.data_ptr()):
                    return False
                i += 1
        return True


def fusable_linears(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` can run as one matmul over their weights concatenated: all plain
    linears (:func:`plain_linear`), biases on all or none, one dtype and device. Global module
    hooks are the caller's to check (:func:`global_hooks`)."""
    if not all(plain_linear(m) for m in modules):
        return False
    params = [m._parameters[n] for m in modules for n in ("weight", "bias")]
    has_bias = {p is not None for p in params[1::2]}
    kinds = {(p.dtype, p.device) for p in params if p is not None}
    return len(has_bias) == 1 and len(kinds) == 1


def fused_linear(
    owner: nn.Module, key: str, names: tuple[str, ...], x: torch.Tensor
) -> torch.Tensor | None:
    """x (..., D) -> the outputs of the linears ``owner.<name>`` for each of ``names``,
    concatenated on the last dim (..., sum N), in one matmul with their weights concatenated
    (:func:`fused_weights`); None when the fast path does not apply (see there). The caller
    then calls the modules one by one."""
    w = fused_weights(owner, key, names)
    return None if w is None else dense(x, w[0], w[1])


def fused_weights(
    owner: nn.Module, key: str, names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The fused weight (sum N, D) and bias (sum N,) or None of the linears ``owner.<name>``
    for each of ``names``, cached on ``owner`` under ``key`` and rebuilt when stale (see the
    module docstring); None when the fast path does not apply: gradients on, a module that is
    not a plain linear (:func:`plain_linear`), a global module hook, biases on some but not
    all, mixed dtypes/devices, or under ``torch.compile``. A call with gradients on (a training
    forward) makes every fused copy stale, as the weights may be updated next."""
    if torch.compiler.is_compiling():  # the compiler fuses what it can itself
        return None
    if torch.is_grad_enabled():  # even when off: copies made while on must not outlive this
        _bump()
        return None
    if not ENABLED or global_hooks():
        return None
    modules = [owner._modules[n] for n in names]  # the dict: no nn.Module.__getattr__
    cache: dict[str, _Fused] = owner.__dict__.setdefault("_fused_linears", {})
    fused = cache.get(key)
    if fused is None or not fused.fresh(modules):  # type: ignore[arg-type]
        cache.pop(key, None)  # release the old copy before building the new one
        if not fusable_linears(modules):  # type: ignore[arg-type]
            return None
        params = [m._parameters[n] for m in modules for n in ("weight", "bias")]  # type: ignore[union-attr]
        if any(p is not None and p.is_inference() for p in params):
            return None  # made under torch.inference_mode: no version counter to watch
        fused = cache[key] = _Fused(modules)  # type: ignore[arg-type]
    return fused.weight, fused.bias


def generation() -> int:
    """The current staleness generation: it changes at every optimizer step and training
    forward (see the module docstring). A holder of fused weights (:func:`fused_weights`)
    that read it before taking them must take them again once it has changed."""
    return _generation


def drop_fused(model: nn.Module) -> None:
    """Forget every fused weight cached in ``model`` (they are rebuilt on the next inference
    call): after editing parameters in place through ``.data``, which their version counter
    does not see, or to free their memory."""
    for m in model.modules():
        m.__dict__.pop("_fused_linears", None)
