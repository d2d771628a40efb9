"""Parameter counts of a config, read from the model built on the meta device.

So the real sizes of the presets (GPT-2 small, Llama-3-8B, Mixtral-8x7B ...) can be inspected on
a laptop: :func:`lmlab.models.counting.meta_model` builds the model with shapes and no storage
(nothing is allocated, however large), and the counts are the built modules' parameters,
classified by module type (:func:`lmlab.models.counting.params_by_part`). Tied weights count
once. Legend: D d_model, L n_layers, H heads, K kv heads, hd head_dim, F d_ff, V vocab_size.
"""

from __future__ import annotations

import dataclasses

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.models.counting import meta_model, num_params, params_by_part, variant_types


def attention_params_by_part(cfg: ModelConfig) -> dict[str, int]:
    """One layer's self-attention by part: ``q``, ``k``, ``v``, ``o`` (weights + biases) and
    ``norms`` (QK-norm / V-norm RMSNorm weights over head_dim; HybridNorm turns both on) and
    ``other`` (the kind's own parameters: differential lambdas, sink logits, MLA's latents), read
    from the first attention module of the built model."""
    import torch

    from lmlab.nn.attention import ATTENTION, Attention
    from lmlab.nn.norm import NORM, RMSNorm

    model = meta_model(dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 1))
    types = variant_types(ATTENTION, Attention)
    attn = next((m for m in model.modules() if isinstance(m, types)), None)
    if attn is None:
        raise LmlabError(f"model.kind={cfg.kind} builds no attention module to count")
    out = {p: num_params(proj) if (proj := getattr(attn, f"{p}_proj", None)) else 0 for p in "qkvo"}
    norm_types = variant_types(NORM, torch.nn.LayerNorm, RMSNorm)
    out["norms"] = sum(num_params(m) for m in attn.children() if isinstance(m, norm_types))
    out["other"] = num_params(attn) - sum(out.values())  # lambdas, sinks, latent projections
    return out


def attention_params(cfg: ModelConfig) -> int:
    """One layer's q, k, v, o projections (+ biases) and QK/V-norm weights."""
    return sum(attention_params_by_part(cfg).values())


def _ffn_module(cfg: ModelConfig, kind: str) -> torch.nn.Module:
    from lmlab.nn.ffn import FFN

    sub = dataclasses.replace(cfg, ffn=dataclasses.replace(cfg.ffn, kind=kind))
    with torch.device("meta"):
        return FFN.get(kind, "model.ffn.kind")(sub)


def expert_params(cfg: ModelConfig) -> int:
    """One MoE expert: the FFN named by ``model.ffn.expert``, d_ff wide, built on meta."""
    return num_params(_ffn_module(cfg, cfg.ffn.expert))


def ffn_params(cfg: ModelConfig) -> int:
    """One layer's FFN; for MoE all experts, the router and the shared expert."""
    return num_params(_ffn_module(cfg, cfg.ffn.kind))


def position_params(cfg: ModelConfig) -> int:
    """One position module: a learned (max_seq_len + offset, D) table or T5's (buckets, H)."""
    from lmlab.nn.position import POSITION

    with torch.device("meta"):
        return num_params(POSITION.get(cfg.position.kind, "model.position.kind")(cfg))


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component of the model ``cfg`` builds (on the meta device: nothing is
    allocated): embedding, position, attention (self- and cross-attention q/k/v/o with biases
    and QK/V-norms), ffn, norms, lm_head (the output head, 0 when tied; an encoder's MLM head:
    dense, LayerNorm, output bias and the V x D projection when untied), then the model's own
    parts (an encoder's token_type and pooler), plus ``total`` and ``non_embedding`` (total
    minus the token embedding; a tied LM head is the same matrix). Raises ValueError without
    vocab_size."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count parameters")
    fine = params_by_part(meta_model(cfg))
    attention = sum(fine.pop(k) for k in list(fine) if k.startswith(("attention_", "cross_")))
    parts = {
        "embedding": fine.pop("embedding"),
        "position": fine.pop("position"),
        "attention": attention,
        "ffn": fine.pop("ffn"),
        "norms": fine.pop("norms"),
        "lm_head": fine.pop("lm_head", 0) + fine.pop("mlm_head", 0),
    }
    parts.update(fine)  # the model's own parts: token_type, pooler (an encoder), other
    parts["total"] = sum(parts.values())
    parts["non_embedding"] = parts["total"] - parts["embedding"]
    return parts
