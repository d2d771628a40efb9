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
from lmlab.interop import hf, hf_bert, hf_mistral, hf_mixtral, hf_neox
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
    # Adjusts the config to what the tensors hold (e.g. BERT with or without pooler / MLM head).
    fit_config: Callable[[ModelConfig, dict[str, torch.Tensor]], ModelConfig] | None = None


HF_FAMILIES: Registry[HFFamily] = Registry("hf_family")


def _require(cond: bool, family: str, what: str) -> None:
    if not cond:
        raise NotRepresentable(f"{family} has no counterpart for {what}")


def _common_attention(cfg: ModelConfig, family: str) -> None:
    """Checks every family here shares: softmax attention with the scale, no v-norm, no dropout."""
    a = cfg.attention
    _require(a.kind == "softmax", family, f"model.attention.kind={a.kind}")
    _require(a.scaled, family, "model.attention.scaled=false")
    _require(not a.v_norm, family, "model.attention.v_norm")
    _require(cfg.final_norm, family, "model.final_norm=false")
    _require(cfg.block.kind == "pre", family, f"model.block.kind={cfg.block.kind}")


def _llama_from(cfg: ModelConfig, family: str = "Llama", ffn: str = "swiglu") -> dict[str, Any]:
    """lmlab config -> LlamaConfig kwargs; raises NotRepresentable naming the first mismatch."""
    a, p = cfg.attention, cfg.position
    _common_attention(cfg, family)
    _require(cfg.norm.kind == "rmsnorm", family, f"model.norm.kind={cfg.norm.kind}")
    _require(cfg.ffn.kind == ffn, family, f"model.ffn.kind={cfg.ffn.kind}")
    _require(not cfg.block.parallel, family, "model.block.parallel")
    _require(not a.qk_norm, family, "model.attention.qk_norm")
    _require(a.out_bias in (None, a.bias), family, "model.attention.out_bias != bias")
    if family != "Mistral":
        _require(a.mask == "causal", family, f"model.attention.mask={a.mask}")
    _require(p.kind == "rope", family, f"model.position.kind={p.kind}")
    _require(not p.interleaved, family, "model.position.interleaved")
    _require(p.partial_rotary_factor == 1.0, family, "model.position.partial_rotary_factor")
    _require(p.scaling.kind == "none", f"{family} (in lmlab verify)", "model.position.scaling")
    _require(cfg.ffn.bias is False, family, "model.ffn.bias=true")
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


def _mistral_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> MistralConfig kwargs: Llama's with a sliding window."""
    a = cfg.attention
    _require(a.mask == "sliding_window", "Mistral", f"model.attention.mask={a.mask}")
    return {**_llama_from(cfg, "Mistral"), "sliding_window": a.window}


def _mixtral_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> MixtralConfig kwargs: Llama's (or Mistral's) with Mixtral's MoE FFN."""
    f, a = cfg.ffn, cfg.attention
    family = "Mistral" if a.mask == "sliding_window" else "Mixtral"
    kwargs = _llama_from(cfg, family, ffn="moe")
    _require(
        f.router == "topk_softmax" and f.expert == "swiglu",
        "Mixtral",
        "this router/expert (needs topk_softmax, swiglu)",
    )
    _require(not f.shared_expert, "Mixtral", "model.ffn.shared_expert")
    return {
        **kwargs,
        "num_local_experts": f.n_experts,
        "num_experts_per_tok": f.top_k,
        "router_aux_loss_coef": f.aux_loss_coef,
        "sliding_window": a.window if a.mask == "sliding_window" else None,
    }


def _neox_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> GPTNeoXConfig kwargs (the default Mini-GPT is one)."""
    a, p = cfg.attention, cfg.position
    _common_attention(cfg, "GPT-NeoX")
    _require(cfg.norm.kind == "layernorm" and cfg.norm.bias, "GPT-NeoX", "this model.norm")
    _require(
        cfg.ffn.kind == "mlp" and cfg.ffn.bias and cfg.ffn.activation in ("gelu", "relu"),
        "GPT-NeoX",
        "this model.ffn (needs mlp with bias, gelu or relu)",
    )
    _require(
        p.kind == "rope" and not p.interleaved and p.scaling.kind == "none",
        "GPT-NeoX",
        "this model.position (needs half-split rope without scaling)",
    )
    _require(a.mask == "causal" and not a.qk_norm, "GPT-NeoX", "this model.attention mask/norm")
    _require(cfg.n_kv_heads == a.n_heads, "GPT-NeoX", "grouped-query attention")
    _require(a.out_bias in (None, a.bias), "GPT-NeoX", "model.attention.out_bias != bias")
    _require(cfg.head_dim * a.n_heads == cfg.d_model, "GPT-NeoX", "head_dim * n_heads != d_model")
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": cfg.ffn.activation,
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "attention_bias": a.bias,
        "use_parallel_residual": cfg.block.parallel,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": p.rope_theta,
            "partial_rotary_factor": p.partial_rotary_factor,
        },
        "bos_token_id": None,
        "eos_token_id": None,
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
    _common_attention(cfg, "GPT-2")
    _require(
        a.bias and a.out_bias in (None, True) and cfg.n_kv_heads == a.n_heads,
        "GPT-2",
        "this model.attention (needs bias, n_kv_heads = n_heads)",
    )
    _require(a.mask == "causal" and not a.qk_norm, "GPT-2", "this model.attention mask/norm")
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


HF_FAMILIES.register("mistral", "Mistral: Llama + sliding-window attention (Jiang et al. 2023).")(
    HFFamily(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        hf_mistral.mistral_model_config,
        lambda sd, cfg: hf_mistral.hf_state_dict(sd, cfg.tie_embeddings),
        _mistral_from,
    )
)
HF_FAMILIES.register("mixtral", "Mixtral: Mistral + top-2 MoE FFN (Jiang et al. 2024).")(
    HFFamily(
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        hf_mixtral.mixtral_model_config,
        lambda sd, cfg: hf_mixtral.mixtral_state_dict(sd, cfg.tie_embeddings),
        _mixtral_from,
    )
)
HF_FAMILIES.register("qwen2", "Qwen2: Llama + q/k/v biases (Yang et al. 2024).")(
    HFFamily(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        hf_mistral.qwen2_model_config,
        lambda sd, cfg: hf_mistral.hf_state_dict(sd, cfg.tie_embeddings),
    )
)
HF_FAMILIES.register("qwen3", "Qwen3: Llama + QK-norm (Yang et al. 2025).")(
    HFFamily(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        hf_mistral.qwen3_model_config,
        lambda sd, cfg: hf_mistral.hf_state_dict(sd, cfg.tie_embeddings),
    )
)
HF_FAMILIES.register("gpt_neox", "GPT-NeoX / Pythia: LayerNorm, partial RoPE, parallel block.")(
    HFFamily(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        hf_neox.neox_model_config,
        lambda sd, cfg: hf_neox.neox_state_dict(sd, cfg.attention.n_heads, cfg.tie_embeddings),
        _neox_from,
    )
)
HF_FAMILIES.register(
    "bert", "BERT: post-norm bidirectional encoder, MLM head (Devlin et al. 2019)."
)(
    HFFamily(
        "bert",
        "BertForMaskedLM",
        "BertConfig",
        hf_bert.bert_model_config,
        hf_bert.bert_state_dict,
        fit_config=hf_bert.fit_bert_config,
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
