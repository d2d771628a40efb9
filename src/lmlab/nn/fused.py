"""Run-time fast paths for inference: plain linears called without the module machinery, and
several linears reading the same input fused into one matmul (q/k/v, gate/up).

Legend: B batch, T tokens, D in features, N out features. The parameters and their names stay
as they are (``q_proj.weight`` ...): what is fused is a cached concatenation of their weights,
built only with gradients off (``torch.no_grad`` / ``inference_mode``, the decode loop) and
rebuilt whenever a source parameter changes: a new tensor (``load_state_dict`` of another
model's tensors, ``.to()``), or an in-place update, which bumps its version counter (an
optimizer step, ``load_state_dict``'s copy). An in-place edit through ``param.data`` bypasses
the version counter: call :func:`drop_fused` on the model after one.

Only exact ``nn.Linear`` modules with no torch hooks take these paths (a quantized layer,
a parametrized one or one with a forward hook is called as a module), so nothing a user hooked
or replaced is bypassed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module


def _global_hooks() -> bool:
    """Whether any global module hook (``register_module_forward_hook`` ...) is registered."""
    return bool(
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


def plain_linear(m: nn.Module) -> bool:
    """Whether ``m`` is an exact ``nn.Linear`` with no torch hooks of its own (so calling
    ``F.linear`` on its parameters is what calling it does)."""
    return (
        type(m) is nn.Linear
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and not m._backward_hooks
        and not m._backward_pre_hooks
    )


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``: x (..., D) -> (..., N), through ``F.linear`` directly when ``m`` is a plain
    linear (:func:`plain_linear`; no global module hooks), which skips the microseconds of
    ``nn.Module.__call__`` (a decode step makes hundreds of these calls)."""
    if plain_linear(m) and not _global_hooks():
        p = m._parameters  # the dict itself: no nn.Module.__getattr__ per parameter
        return F.linear(x, p["weight"], p["bias"])  # type: ignore[arg-type]
    return m(x)


# Off by default: with it on, three resume tests (seq2seq, MLM, compare) gave a val loss off by
# ~1e-3 after training resumed, i.e. a fused weight went stale somewhere (not found yet).
# True only for A/B runs (benchmarks) until that is understood.
ENABLED = False


class _Fused:
    """One fused weight (sum N, D) and bias (sum N,) or None, with what it was built from: the
    modules, their parameters, an alias of each one's data (which keeps its memory alive, so a
    new tensor cannot take its address) and its version."""

    def __init__(self, modules: list[nn.Module]) -> None:
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
        parameter tensors, unchanged since (same version, same memory)."""
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


def fused_linear(
    owner: nn.Module, key: str, names: tuple[str, ...], x: torch.Tensor
) -> torch.Tensor | None:
    """x (..., D) -> the outputs of the linears ``owner.<name>`` for each of ``names``,
    concatenated on the last dim (..., sum N), in one matmul with their weights concatenated
    (cached on ``owner`` under ``key``); None when the fast path does not apply: gradients on,
    a module that is not a plain linear (:func:`plain_linear`), a global module hook, biases on
    some but not all, mixed dtypes/devices, or under ``torch.compile``. The caller then calls
    the modules one by one."""
    if not ENABLED or torch.is_grad_enabled() or _global_hooks():
        return None
    if torch.compiler.is_compiling():  # the compiler fuses what it can itself
        return None
    modules = [owner._modules[n] for n in names]  # the dict: no nn.Module.__getattr__
    cache: dict[str, _Fused] = owner.__dict__.setdefault("_fused_linears", {})
    fused = cache.get(key)
    if fused is None or not fused.fresh(modules):  # type: ignore[arg-type]
        cache.pop(key, None)  # release the old copy before building the new one
        if not all(plain_linear(m) for m in modules):  # type: ignore[arg-type]
            return None
        params = [m._parameters[n] for m in modules for n in ("weight", "bias")]  # type: ignore[union-attr]
        has_bias = {p is not None for p in params[1::2]}
        kinds = {(p.dtype, p.device) for p in params if p is not None}
        if len(has_bias) > 1 or len(kinds) > 1:
            return None
        if any(p is not None and p.is_inference() for p in params):
            return None  # made under torch.inference_mode: no version counter to watch
        fused = cache[key] = _Fused(modules)  # type: ignore[arg-type]
    return F.linear(x, fused.weight, fused.bias)


def drop_fused(model: nn.Module) -> None:
    """Forget every fused weight cached in ``model`` (they are rebuilt on the next inference
    call): after editing parameters in place through ``.data``, which their version counter
    does not see, or to free their memory."""
    for m in model.modules():
        m.__dict__.pop("_fused_linears", None)
