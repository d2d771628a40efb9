"""Parameter and FLOP counting of a built model, shared by every model family.

Counts are read from the module tree, never from a second closed-form copy of the shapes: a
model built on PyTorch's ``meta`` device (:func:`meta_model`) has every parameter's shape and no
storage, so even a 70B configuration is counted in well under a second without allocating it.

- :func:`params_by_part`: distinct parameters (tied weights once) by part, classified by module
  type (attention, FFN, norm, position registries) and by the model's own top-level names;
- :func:`matmul_params`: the weights of every nn.Linear a token passes through, an MoE layer
  answering for itself (router + top_k + shared experts,
  :meth:`lmlab.nn.moe.MoE.matmul_params_per_token`);
- :func:`score_flops`: what the attention modules declare they compute besides their weights.

A model family wires these into its own FLOP convention (``flops_per_token`` on
:class:`~lmlab.models.decoder.DecoderLM`, :class:`~lmlab.models.encoder.EncoderLM`,
:class:`~lmlab.models.encoder_decoder.EncoderDecoderLM`) and names its decoding layers
(``cache_attention``, ``cross_cache_attention``) for the KV-cache size.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lmlab.config import ModelConfig

# top-level module name -> part, for a model that declares no ``param_parts()``
DEFAULT_PARTS = {"embed": "embedding", "lm_head": "lm_head"}
PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


def num_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Distinct parameters of ``model`` (tied weights counted once); ``non_embedding`` leaves out
    the token embedding ``model.embed`` (and a head tied to it, which is the same matrix)."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if non_embedding:
        n -= model.embed.weight.numel()  # type: ignore[union-attr,operator]
    return n


_META_CACHE: OrderedDict[tuple[str, tuple[int, ...]], nn.Module] = OrderedDict()


def _registry_state() -> tuple[int, ...]:
    """The identity of every registered variant: a cached model is rebuilt when a plugin
    registers, unregisters or replaces one."""
    from lmlab.registry import families

    return tuple(id(obj) for reg in families().values() for _, obj in reg.items())


def meta_model(cfg: ModelConfig) -> nn.Module:
    """``build_model(cfg)`` on the meta device: every parameter's shape, no storage (nothing is
    allocated, whatever the size). The last few are kept, keyed by the config's value and the
    registries, so the counts of one ``lmlab inspect`` share one build. Do not run or change it.
    Raises what build_model raises (LmlabError without vocab_size, ConfigError for a bad kind)."""
    from lmlab.models.build import build_model

    key = (repr(cfg.to_dict()), _registry_state())  # to_dict: repr leaves variant fields out
    if key in _META_CACHE:
        _META_CACHE.move_to_end(key)
        return _META_CACHE[key]
    with torch.device("meta"):
        model = build_model(copy.deepcopy(cfg))
    _META_CACHE[key] = model
    while len(_META_CACHE) > 4:
        _META_CACHE.popitem(last=False)
    return model


def variant_types(family: Any, *extra: type) -> tuple[type, ...]:
    """The classes registered in ``family`` (a Registry), after ``extra``: for isinstance."""
    return (*extra, *(obj for _, obj in family.items() if isinstance(obj, type)))


def params_by_part(model: nn.Module) -> dict[str, int]:
    """Distinct parameters of ``model`` by part (tied weights once, under the part met first),
    summing to :func:`num_params`:

    embedding, position (PositionEncoding modules), attention_q/k/v/o (each projection's weight
    and bias in every self-attention), cross_attention_q/k/v/o (only in a model with
    cross-attention), attention_norms (QK/V-norm weights in any attention), attention_other
    (only when some attention has parameters of its own beyond q/k/v/o and norms: differential
    attention's lambdas, sink logits, MLA's latent projections), ffn (FFN modules; an
    MoE layer's router and every expert), norms (every other norm), then the parts the model
    names in ``param_parts()`` (top-level module name -> part; default embed -> embedding,
    lm_head -> lm_head), then ``other`` for anything else (absent when 0)."""
    from lmlab.nn.attention import ATTENTION, Attention
    from lmlab.nn.cross_attention import CrossAttention
    from lmlab.nn.ffn import FFN
    from lmlab.nn.norm import NORM, RMSNorm
    from lmlab.nn.position import POSITION, PositionEncoding

    declared = getattr(model, "param_parts", None)
    heads: dict[str, str] = declared() if callable(declared) else DEFAULT_PARTS
    attention = variant_types(ATTENTION, Attention)
    ffn, position = variant_types(FFN), variant_types(POSITION, PositionEncoding)
    norms = variant_types(NORM, nn.LayerNorm, RMSNorm)
    has_cross = any(isinstance(m, CrossAttention) for m in model.modules())
    order = ["embedding", "position", *(f"attention_{p}" for p in "qkvo")]
    order += [f"cross_attention_{p}" for p in "qkvo"] if has_cross else []
    order += ["attention_norms", "ffn", "norms"]
    order += [part for part in heads.values() if part not in order]
    counts = dict.fromkeys(order, 0)
    seen: set[int] = set()

    def add(part: str, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                counts[part] = counts.get(part, 0) + p.numel()

    def walk(module: nn.Module, top: bool) -> None:
        add("other", module.parameters(recurse=False))
        for name, child in module.named_children():
            part = heads.get(name) if top else None
            if part is None and isinstance(child, attention):
                prefix = "cross_attention_" if isinstance(child, CrossAttention) else "attention_"
                add("attention_other", child.parameters(recurse=False))  # lambdas, sinks
                for sub, grandchild in child.named_children():
                    proj = PROJECTIONS.get(sub)
                    other = (
                        "attention_norms" if isinstance(grandchild, norms) else "attention_other"
                    )
                    add(prefix + proj if proj else other, grandchild.parameters())
                continue
            if part is None:
                kinds = ((ffn, "ffn"), (norms, "norms"), (position, "position"))
                part = next((p for types, p in kinds if isinstance(child, types)), None)
            if part is None:
                walk(child, False)
            else:
                add(part, child.parameters())

    walk(model, True)
    for extra in ("attention_other", "other"):
        if not counts.get(extra):
            counts.pop(extra, None)
    return counts


def matmul_params(module: nn.Module) -> int:
    """Weights of every nn.Linear in ``module`` a token passes through (biases left out; a head
    tied to the embedding still counts: the product is computed). A submodule declaring
    ``matmul_params_per_token()`` (an MoE layer: router + top_k + shared experts) answers for
    itself."""
    declared = getattr(module, "matmul_params_per_token", None)
    if callable(declared):
        return int(declared())
    if isinstance(module, nn.Linear):
        return module.weight.numel()
    return sum(matmul_params(child) for child in module.children())


def score_flops(attentions: Iterable[nn.Module], cfg: ModelConfig, seq_len: int) -> int:
    """FLOPs per query token that the attention modules compute besides their weights (QK^T and
    AV against ``seq_len`` keys), summed over the modules: each class declares its own
    ``score_flops_per_token(cfg, seq_len)``. Raises LmlabError for a class that declares none."""
    return sum(declared(a, "score_flops_per_token")(cfg, seq_len) for a in attentions)


def declared(module: nn.Module, name: str) -> Any:
    """The cost method ``name`` that ``module``'s class declares (LmlabError naming the class
    when it declares none: a variant must say what cannot be measured from its weights)."""
    from lmlab.errors import LmlabError

    method = getattr(type(module), name, None)
    if method is None:
        raise LmlabError(f"{type(module).__name__} declares no {name}(), so it cannot be counted")
    return method


def active_params(model: nn.Module) -> int:
    """Parameters one token uses: :func:`num_params` less what the layers declaring
    ``active_params()`` (MoE: router + top_k + shared experts) leave idle."""
    total = num_params(model)
    for m in model.modules():
        own = getattr(m, "active_params", None)
        if callable(own) and m is not model:
            total -= num_params(m) - int(own())
    return total


def moe_summary(model: nn.Module) -> dict[str, Any] | None:
    """n_experts, top_k, shared_expert of the first MoE layer, and over all MoE layers
    params_per_expert (one routed expert), params_router and params_experts (routed + shared);
    None without an MoE layer."""
    from lmlab.nn.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    first = layers[0]
    return {
        "n_experts": first.n_experts,
        "top_k": first.top_k,
        "shared_expert": first.shared_expert is not None,
        "params_per_expert": num_params(first.experts[0]),
        "params_router": sum(num_params(m.router) for m in layers),
        "params_experts": sum(num_params(m) - num_params(m.router) for m in layers),
    }
