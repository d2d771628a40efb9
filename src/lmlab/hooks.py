"""Read and edit a model's activations by name: :func:`run_with_cache`, :func:`run_with_hooks`.

Every model kind carries :class:`~lmlab.nn.hooks.HookPoint` identities on its activations,
named by module path (list them with :func:`hook_names`). Legend: B batch, T tokens, S key
tokens, D d_model, H heads, K kv heads, hd head_dim, F d_ff, V vocab, E experts, N = B T.

=================================  ===========================================================
``hook_embed``                     (B, T, D) token embedding x embed_scale, before positions
``layers.{i}.hook_resid_pre``      (B, T, D) residual stream entering layer i (hyper: (B, T,
                                   n, D))
``layers.{i}.hook_resid_mid``      (B, T, D) after the attention sublayer (pre/post/hybrid,
                                   not parallel or hyper blocks)
``layers.{i}.hook_resid_cross``    (B, T, D) after cross-attention (encoder-decoder decoder)
``layers.{i}.hook_resid_post``     (B, T, D) leaving layer i
``layers.{i}.attn.hook_q``         (B, H, T, hd) after QK-norm and RoPE
``layers.{i}.attn.hook_k/_v``      (B, K, T, hd) the new tokens' keys/values, before the cache
``layers.{i}.attn.hook_scores``    (B, H, T, S) pre-softmax scores, -inf where masked
``layers.{i}.attn.hook_pattern``   (B, H, T, S) attention weights (before dropout)
``layers.{i}.attn.hook_z``         (B, H, T, hd) per-head output, before o_proj
``layers.{i}.attn.hook_out``       (B, T, D) o_proj output
``layers.{i}.ffn.hook_hidden``     (B, T, F) what down_proj reads
``layers.{i}.ffn.hook_out``        (B, T, D)
``layers.{i}.ffn.hook_router_*``   MoE: ``hook_router_logits`` (N, E) float32,
                                   ``hook_choices`` (N, top_k) int64, ``hook_gates`` (N, top_k)
``hook_final_norm``                (B, T, D) the final norm's output
``hook_logits``                    (B, T, V)
=================================  ===========================================================

Per attention kind (docs/interpretability.md): differential's maps are (B, H/2, T, S) with
``hook_scores_2`` / ``hook_pattern_2`` for the second; sink's pattern has a last column for the
sink; MLA's q/k/v are the expanded heads (``absorb: false`` only; k, v over all S keys);
linear's scores are the masked phi(q) phi(k)^T; nsa has no scores or pattern (three branches);
moba runs its dense path while a scores/pattern hook is on. A scores or pattern hook makes that
layer use the math formula for the call (the fused kernel never materialises them). A model
forward with ``need_weights=True`` records the same points for that call (its ``attentions``
are the patterns, :mod:`lmlab.models.stack`), after any function registered here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lmlab.errors import LmlabError
from lmlab.nn.hooks import HookFn, HookPoint, name_hook_points

NameFilter = Sequence[str] | Callable[[str], bool] | None


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Hook name -> its :class:`HookPoint`, in module order."""
    return name_hook_points(model)


def hook_names(model: nn.Module) -> list[str]:
    """Every hook name of ``model``, in module order (``hook_embed``, ``layers.0.hook_resid_pre``,
    ..., ``hook_logits``)."""
    return list(hook_points(model))


def _unknown(name: str, known: Sequence[str]) -> LmlabError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return LmlabError(
        f"unknown hook name {name!r}{hint} (lmlab.hooks.hook_names(model) lists all {len(known)})"
    )


def _resolve(model: nn.Module, names: Sequence[str]) -> dict[str, HookPoint]:
    points = hook_points(model)
    for name in names:
        if name not in points:
            raise _unknown(name, list(points))
    return {name: points[name] for name in names}


@contextmanager
def hooks(
    model: nn.Module, fns: Mapping[str, HookFn] | Sequence[tuple[str, HookFn]]
) -> Iterator[set[str]]:
    """Register ``fns`` (hook name -> ``fn(tensor, name) -> tensor or None``; a sequence of
    pairs may name one point twice) for the ``with`` body; every one is removed on leaving,
    error or not. Yields the set of names whose points ran. Raises LmlabError for an unknown
    name before anything is registered."""
    pairs = list(fns.items()) if isinstance(fns, Mapping) else list(fns)
    points = _resolve(model, [name for name, _ in pairs])
    fired: set[str] = set()
    added: list[tuple[HookPoint, HookFn]] = []

    def marker(name: str) -> HookFn:
        def mark(x: torch.Tensor, _: str) -> None:
            fired.add(name)

        return mark

    try:
        for name in dict.fromkeys(name for name, _ in pairs):
            m = marker(name)
            points[name].fns.append(m)
            added.append((points[name], m))
        for name, fn in pairs:
            points[name].fns.append(fn)
            added.append((points[name], fn))
        yield fired
    finally:
        for point, fn in added:
            point.fns.remove(fn)


def _forward(model: nn.Module, ids: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
    return model(**kwargs) if ids is None else model(ids, **kwargs)


def _check_fired(names: Sequence[str], fired: set[str]) -> None:
    missing = [n for n in names if n not in fired]
    if missing:
        raise LmlabError(
            f"hook point(s) {', '.join(missing)} did not run in this forward pass (this "
            "attention kind or configuration does not compute them; see docs/interpretability.md)"
        )


def run_with_hooks(
    model: nn.Module,
    ids: torch.Tensor | None,
    fns: Mapping[str, HookFn] | Sequence[tuple[str, HookFn]],
    **forward_kwargs: Any,
) -> Any:
    """``model(ids, **forward_kwargs)`` with ``fns`` registered: each ``fn(tensor, name)`` reads
    the activation and may return a replacement of the same shape (zero or mean ablation,
    patching). Returns the model's output. The hooks are removed afterwards, even on error.
    Raises LmlabError for an unknown name (with close names) or a named point that did not run
    (e.g. ``hook_pattern`` of nsa)."""
    pairs = list(fns.items()) if isinstance(fns, Mapping) else list(fns)
    with hooks(model, pairs) as fired:
        out = _forward(model, ids, forward_kwargs)
    _check_fired([name for name, _ in pairs], fired)
    return out


class ActivationCache(dict):
    """Hook name -> activation (detached, as the forward computed it). A missing name raises
    LmlabError with close names."""

    def __missing__(self, name: str) -> torch.Tensor:
        raise _unknown(name, list(self))


def run_with_cache(
    model: nn.Module,
    ids: torch.Tensor | None,
    names: NameFilter = None,
    **forward_kwargs: Any,
) -> tuple[Any, ActivationCache]:
    """Run ``model(ids, **forward_kwargs)`` and record activations: ``names`` None for every
    hook point that runs, a list of hook names (each must run), or a predicate on the name.
    Returns (the model's output, :class:`ActivationCache`). Recording scores or patterns makes
    those layers use the math formula for this call; nothing else changes. Raises LmlabError
    for an unknown name or a point that ran twice in one pass."""
    all_names = hook_names(model)
    if names is None:
        chosen = all_names
    elif callable(names):
        chosen = [n for n in all_names if names(n)]
    else:
        chosen = list(names)
    cache = ActivationCache()

    def record(x: torch.Tensor, name: str) -> None:
        if name in cache:
            raise LmlabError(f"hook point {name!r} ran twice in one forward pass")
        cache[name] = x.detach()

    with hooks(model, [(name, record) for name in chosen]) as fired:
        out = _forward(model, ids, forward_kwargs)
    if names is not None and not callable(names):
        _check_fired(chosen, fired)
    return out, cache
