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
        return F.linear(x, m.weight, m.bias)  # type: ignore[arg-type]
    return m(x)


class _Fused:
    """One fused weight (sum N, D) and bias (sum N,) or None, with what it was built from: the
    source parameters, an alias of each one's data (which keeps its memory alive, so a new
    tensor cannot take its address) and its version."""

    def __init__(self, params: list[torch.Tensor | None]) -> None:
        self.params = params
        self.data = [p.data if p is not None else None for p in params]
        self.versions = [p._version if p is not None else 0 for p in params]
        weights = [p for p in params[::2] if p is not None]
        biases = [p for p in params[1::2] if p is not None]
        self.weight = torch.cat(weights, dim=0)
        self.bias = torch.cat(biases, dim=0) if biases else None

    def fresh(self, params: list[torch.Tensor | None]) -> bool:
        """Whether ``params`` are the very tensors this was built from, unchanged since."""
        for p, q, d, v in zip(params, self.params, self.data, self.versions, strict=True):
            if p is not q:
                return False
            if p is not None and (p._version != v or p.data_ptr() != d.data_ptr()):  # type: ignore[union-attr]
                return False
        return True


def fused_linear(
    owner: nn.Module, key: str, modules: list[nn.Module], x: torch.Tensor
) -> torch.Tensor | None:
    """x (..., D) -> the outputs of every linear of ``modules`` concatenated on the last dim
    (..., sum N), in one matmul with their weights concatenated (cached on ``owner`` under
    ``key``); None when the fast path does not apply: gradients on, a module that is not a
    plain linear (:func:`plain_linear`), a global module hook, biases on some but not all, or
    mixed dtypes/devices. The caller then calls the modules one by one."""
    if torch.is_grad_enabled() or _global_hooks():
        return None
    if not all(plain_linear(m) for m in modules):
        return None
    params: list[torch.Tensor | None] = []
    linears: list[nn.Linear] = modules  # type: ignore[assignment]  # checked just above
    for m in linears:
        params += [m.weight, m.bias]
    has_bias = {m.bias is not None for m in linears}
    kinds = {(p.dtype, p.device) for p in params if p is not None}
    if len(has_bias) > 1 or len(kinds) > 1:
        return None
    cache: dict[str, _Fused] = owner.__dict__.setdefault("_fused_linears", {})
    fused = cache.get(key)
    if fused is None or not fused.fresh(params):
        cache.pop(key, None)  # release the old copy before building the new one
        fused = cache[key] = _Fused(params)
    return F.linear(x, fused.weight, fused.bias)


def drop_fused(model: nn.Module) -> None:
    """Forget every fused weight cached in ``model`` (they are rebuilt on the next inference
    call): after editing parameters in place through ``.data``, which their version counter
    does not see, or to free their memory."""
    for m in model.modules():
        m.__dict__.pop("_fused_linears", None)
