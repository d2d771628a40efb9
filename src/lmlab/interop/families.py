"""The Hugging Face model families lmlab maps onto its components, in one table.

Each :class:`HFFamily` knows how to read a ``config.json`` (``to_config``), rename a state dict
(``to_state``), and, where lmlab's config has an exact counterpart, write the Hugging Face
config back (``from_config``, used by ``lmlab verify`` to build a reference model). The table is
keyed by ``config.json``'s ``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.interop import hf
from lmlab.registry import Registry


class NotRepresentable(LmlabError):
    """An lmlab config has a component the family's Hugging Face class does not have."""


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face decoder family: names and the three maps."""

    model_type: str  # config.json "model_type"
    hf_class: str  # transformers class of the causal LM, e.g. "LlamaForCausalLM"
    hf_config_class: str  # e.g. "LlamaConfig"
    to_config: Callable[[Any], ModelConfig]
    to_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    from_config: Callable[[ModelConfig], dict[str, Any]] | None = None


HF_FAMILIES: Registry[HFFamily] = Registry("hf_family")


def _require(cond: bool, family: str, what: str) -> None:
    if not cond:
        raise NotRepresentable(f"{family} has no counterpart for {what}")


def _llama_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> LlamaConfig kwargs; raises NotRepresentable naming the first mismatch."""
    a, p = cfg.attention, cfg.position
    _require(cfg.norm.kind == "rmsnorm", "Llama", f"model.norm.kind={cfg.norm.kind}")
    _require(cfg.ffn.kind == "swiglu", "Llama", f"model.ffn.kind={cfg.ffn.kind}")
    _require(p.kind == "rope", "Llama", f"model.position.kind={p.kind}")
    _require(cfg.block.kind == "pre" and not cfg.block.parallel, "Llama", "this model.block")
    _require(a.kind == "softmax", "Llama", f"model.attention.kind={a.kind}")
    _require(cfg.ffn.bias is False, "Llama", "model.ffn.bias=true")
    _require(cfg.final_norm, "Llama", "model.final_norm=false")
    for name in ("interleaved", "partial_rotary_factor", "scaling"):  # added by later variants
        value = getattr(p, name, None)
        _require(
            value in (None, False, 1.0) or getattr(value, "kind", "none") == "none",
            "Llama (in lmlab verify)",
            f"model.position.{name}",
        )
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": a.bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": p.rope_theta},
    }


def _gpt2_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> GPT2Config kwargs; raises NotRepresentable naming the first mismatch."""
    a = cfg.attention
    _require(cfg.position.kind == "learned", "GPT-2", f"model.position.kind={cfg.position.kind}")
    _require(cfg.norm.kind == "layernorm" and cfg.norm.bias, "GPT-2", "this model.norm")
    _require(
        cfg.ffn.kind == "mlp" and cfg.ffn.activation == "gelu_tanh" and cfg.ffn.bias,
        "GPT-2",
        "this model.ffn (needs mlp, gelu_tanh, bias)",
    )
    _require(
        a.kind == "softmax" and a.bias and cfg.n_kv_heads == a.n_heads,
        "GPT-2",
        "this model.attention (needs softmax, bias, n_kv_heads = n_heads)",
    )
    _require(cfg.head_dim * a.n_heads == cfg.d_model, "GPT-2", "head_dim * n_heads != d_model")
    _require(cfg.block.kind == "pre" and not cfg.block.parallel, "GPT-2", "this model.block")
    _require(cfg.tie_embeddings and cfg.final_norm, "GPT-2", "untied or unnormalised output")
    return {
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": a.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }


HF_FAMILIES.register("llama", "Llama: RMSNorm, SwiGLU, RoPE, GQA (Touvron et al. 2023).")(
    HFFamily(
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        hf.llama_model_config,
        lambda sd, cfg: hf.llama_state_dict(sd, cfg.tie_embeddings),
        _llama_from,
    )
)
HF_FAMILIES.register(
    "gpt2", "GPT-2: LayerNorm, learned positions, GELU MLP (Radford et al. 2019)."
)(
    HFFamily(
        "gpt2",
        "GPT2LMHeadModel",
        "GPT2Config",
        hf.gpt2_model_config,
        lambda sd, cfg: hf.gpt2_state_dict(sd, cfg.d_model),
        _gpt2_from,
    )
)


def family_for(model_type: str) -> HFFamily:
    """The family of a ``config.json`` ``model_type``; LmlabError lists the supported ones."""
    if model_type not in HF_FAMILIES.names():
        raise LmlabError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: "
            f"{', '.join(HF_FAMILIES.names())}"
        )
    return HF_FAMILIES.get(model_type)
