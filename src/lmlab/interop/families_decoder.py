"""The Hugging Face decoder families: Llama, GPT-2, Mistral, Mixtral, Qwen2, Qwen3, GPT-NeoX,
DiffLlama.

Each family reads a ``config.json`` and renames a state dict (lmlab.interop.hf*), and writes the
Hugging Face config back where lmlab's config has an exact counterpart (``from_config``: every
mismatch listed in one NotRepresentable). Registered in :data:`lmlab.interop.hf_family.HF_FAMILIES`
when :mod:`lmlab.interop.families` imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.interop import hf, hf_diffllama, hf_mistral, hf_mixtral, hf_neox
from lmlab.interop.hf_family import HF_FAMILIES, HFFamily, NotRepresentable
from lmlab.nn.differential import lambda_std_dev


class _Checks:
    """Collects every setting of an lmlab config a family has no counterpart for."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.missing: list[str] = []

    def require(self, cond: bool, what: str) -> None:
        if not cond and what not in self.missing:
            self.missing.append(what)

    def done(self) -> None:
        """Raise NotRepresentable listing every mismatch, if any."""
        if self.missing:
            raise NotRepresentable(self.family, self.missing)


def _common_checks(cfg: ModelConfig, c: _Checks, attention: str = "softmax") -> None:
    """Checks every family here shares: a decoder with ``attention`` (softmax but for
    DiffLlama) with the 1/sqrt(hd) scale, no v-norm, a final norm, Pre-Norm."""
    a = cfg.attention
    c.require(cfg.kind == "decoder", f"model.kind={cfg.kind}")
    c.require(a.kind == attention, f"model.attention.kind={a.kind}")
    c.require(a.scaled, "model.attention.scaled=false")
    c.require(not a.v_norm, "model.attention.v_norm")
    c.require(cfg.final_norm, "model.final_norm=false")
    c.require(cfg.block.kind == "pre", f"model.block.kind={cfg.block.kind}")
    c.require(cfg.block.residual, "model.block.residual=false")
    c.require(cfg.embed_scale == 1.0, "model.scale_embedding (token embeddings * sqrt(d_model))")


def _rope_checks(cfg: ModelConfig, c: _Checks, partial: bool = False) -> None:
    """Half-split RoPE (``partial``: any partial_rotary_factor) with a context scaling Hugging
    Face has (:data:`lmlab.interop.hf.HF_ROPE_TYPES`)."""
    p, s = cfg.position, cfg.position.scaling
    c.require(p.kind == "rope", f"model.position.kind={p.kind}")
    c.require(not p.interleaved, "model.position.interleaved")
    c.require(partial or p.partial_rotary_factor == 1.0, "model.position.partial_rotary_factor")
    c.require(s.kind in hf.HF_ROPE_TYPES.values(), f"model.position.scaling.kind={s.kind}")
    if s.kind == "dynamic_ntk":  # HF rescales past max_position_embeddings
        original = s.original_max_seq_len or cfg.max_seq_len
        c.require(original == cfg.max_seq_len, "model.position.scaling.original_max_seq_len")
    if s.kind == "yarn":  # HF reads mscale only with mscale_all_dim
        c.require((s.mscale is None) == (s.mscale_all_dim is None), "model.position.scaling.mscale")


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) of a RoPE model: the inverse of
    :func:`lmlab.interop.hf.rope_position_config`."""
    p, s = cfg.position, cfg.position.scaling
    hf_type = {v: k for k, v in hf.HF_ROPE_TYPES.items()}.get(s.kind, "default")
    params: dict[str, Any] = {"rope_type": hf_type, "rope_theta": p.rope_theta}
    if hf_type != "default":
        params["factor"] = s.factor
    if hf_type == "yarn":
        params["original_max_position_embeddings"] = s.original_max_seq_len or cfg.max_seq_len
        params.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
        if s.mscale is not None and s.mscale_all_dim is not None:
            params.update(mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
    return params


def _llama_checks(
    cfg: ModelConfig, c: _Checks, ffn: str = "swiglu", attention: str = "softmax"
) -> None:
    """Llama's shape: RMSNorm, ``ffn`` without bias, sequential block, half-split RoPE."""
    _common_checks(cfg, c, attention)
    c.require(cfg.norm.kind == "rmsnorm", f"model.norm.kind={cfg.norm.kind}")
    c.require(cfg.ffn.kind == ffn, f"model.ffn.kind={cfg.ffn.kind}")
    c.require(not cfg.ffn.bias, "model.ffn.bias=true")
    c.require(not cfg.block.parallel, "model.block.parallel")
    _rope_checks(cfg, c)


def _llama_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    a = cfg.attention
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
        "rope_parameters": _rope_parameters(cfg),
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _llama_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> LlamaConfig kwargs; raises NotRepresentable naming every mismatch."""
    a, c = cfg.attention, _Checks("Llama")
    _llama_checks(cfg, c)
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(a.out_bias in (None, a.bias), "model.attention.out_bias != bias")
    c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
    c.done()
    return {**_llama_kwargs(cfg), "attention_bias": a.bias}


def _diffllama_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> DiffLlamaConfig kwargs: Llama's with differential attention."""
    a, c = cfg.attention, _Checks("DiffLlama")
    _llama_checks(cfg, c, attention="differential")
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(a.out_bias in (None, a.bias), "model.attention.out_bias != bias")
    c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
    c.done()
    std = lambda_std_dev(cfg)
    return {**_llama_kwargs(cfg), "attention_bias": a.bias, "lambda_std_dev": std}


def _mistral_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> MistralConfig kwargs: Llama's with a sliding window."""
    a, c = cfg.attention, _Checks("Mistral")
    _llama_checks(cfg, c)
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(not a.bias and a.out_bias in (None, False), "model.attention.bias")
    c.require(a.mask == "sliding_window", f"model.attention.mask={a.mask}")
    c.done()
    return {**_llama_kwargs(cfg), "sliding_window": a.window}


def _mixtral_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> MixtralConfig kwargs: Mistral's attention (a sliding window or none) with
    Mixtral's MoE FFN (top-k-then-softmax router over SwiGLU experts)."""
    f, a, c = cfg.ffn, cfg.attention, _Checks("Mixtral")
    _llama_checks(cfg, c, ffn="moe")
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(not a.bias and a.out_bias in (None, False), "model.attention.bias")
    c.require(a.mask in ("causal", "sliding_window"), f"model.attention.mask={a.mask}")
    c.require(f.router == "topk_softmax", f"model.ffn.router={f.router}")
    c.require(f.expert == "swiglu", f"model.ffn.expert={f.expert}")
    c.require(not f.shared_expert, "model.ffn.shared_expert")
    c.done()
    return {
        **_llama_kwargs(cfg),
        "num_local_experts": f.n_experts,
        "num_experts_per_tok": f.top_k,
        "router_aux_loss_coef": f.aux_loss_coef,
        "sliding_window": a.window if a.mask == "sliding_window" else None,
    }


def _qwen_from(cfg: ModelConfig, family: str, c: _Checks) -> dict[str, Any]:
    """Llama's kwargs plus Qwen's sliding-window fields (every layer windowed, or none)."""
    a = cfg.attention
    _llama_checks(cfg, c)
    c.require(a.mask in ("causal", "sliding_window"), f"model.attention.mask={a.mask}")
    c.done()
    windowed = a.mask == "sliding_window"
    return {
        **_llama_kwargs(cfg),
        "use_sliding_window": windowed,
        "sliding_window": a.window if windowed else None,
        "max_window_layers": 0 if windowed else cfg.n_layers,
        "layer_types": [("sliding" if windowed else "full") + "_attention"] * cfg.n_layers,
    }


def _qwen2_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> Qwen2Config kwargs: Llama's with bias on q/k/v and none on o."""
    a, c = cfg.attention, _Checks("Qwen2")
    c.require(a.bias and a.out_bias is False, "model.attention.bias without out_bias")
    c.require(not a.qk_norm, "model.attention.qk_norm")
    return _qwen_from(cfg, "Qwen2", c)


def _qwen3_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> Qwen3Config kwargs: Llama's with QK-norm."""
    a, c = cfg.attention, _Checks("Qwen3")
    c.require(a.qk_norm, "model.attention.qk_norm=false")
    c.require(a.out_bias in (None, a.bias), "model.attention.out_bias != bias")
    return {**_qwen_from(cfg, "Qwen3", c), "attention_bias": a.bias}


def _neox_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> GPTNeoXConfig kwargs (the default Mini-GPT is one)."""
    a, p, c = cfg.attention, cfg.position, _Checks("GPT-NeoX")
    _common_checks(cfg, c)
    c.require(cfg.norm.kind == "layernorm", f"model.norm.kind={cfg.norm.kind}")
    c.require(cfg.norm.bias, "model.norm.bias=false")
    c.require(cfg.ffn.kind == "mlp", f"model.ffn.kind={cfg.ffn.kind}")
    c.require(cfg.ffn.bias, "model.ffn.bias=false")
    c.require(
        cfg.ffn.activation in ("gelu", "relu", "gelu_tanh", "silu"),
        f"model.ffn.activation={cfg.ffn.activation}",
    )
    _rope_checks(cfg, c, partial=True)
    c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(cfg.n_kv_heads == a.n_heads, "grouped-query attention (model.attention.n_kv_heads)")
    c.require(a.out_bias in (None, a.bias), "model.attention.out_bias != bias")
    c.require(cfg.head_dim * a.n_heads == cfg.d_model, "model.attention.head_dim")
    c.done()
    act = {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.ffn.activation, cfg.ffn.activation)
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": act,
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "attention_bias": a.bias,
        "use_parallel_residual": cfg.block.parallel,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "rope_parameters": {
            **_rope_parameters(cfg),
            "partial_rotary_factor": p.partial_rotary_factor,
        },
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _gpt2_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> GPT2Config kwargs; raises NotRepresentable naming every mismatch."""
    a, c = cfg.attention, _Checks("GPT-2")
    _common_checks(cfg, c)
    c.require(cfg.position.kind == "learned", f"model.position.kind={cfg.position.kind}")
    c.require(cfg.norm.kind == "layernorm", f"model.norm.kind={cfg.norm.kind}")
    c.require(cfg.norm.bias, "model.norm.bias=false")
    c.require(cfg.ffn.kind == "mlp", f"model.ffn.kind={cfg.ffn.kind}")
    c.require(cfg.ffn.activation == "gelu_tanh", f"model.ffn.activation={cfg.ffn.activation}")
    c.require(cfg.ffn.bias, "model.ffn.bias=false")
    c.require(a.bias and a.out_bias in (None, True), "model.attention.bias=false")
    c.require(cfg.n_kv_heads == a.n_heads, "grouped-query attention (model.attention.n_kv_heads)")
    c.require(a.mask == "causal", f"model.attention.mask={a.mask}")
    c.require(not a.qk_norm, "model.attention.qk_norm")
    c.require(cfg.head_dim * a.n_heads == cfg.d_model, "model.attention.head_dim")
    c.require(not cfg.block.parallel, "model.block.parallel")
    c.done()
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
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _untied(
    to_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]],
) -> Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]:
    """``to_hf`` with ``lm_head.weight`` left out when the model ties it to the embedding, as
    ``save_pretrained`` writes a tied model (``from_pretrained`` re-ties it)."""

    def from_state(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = to_hf(sd, cfg)
        if cfg.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    return from_state


def _llama_layout(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return hf_mistral.to_hf_state_dict(sd, cfg.tie_embeddings)


HF_FAMILIES.register("llama", "Llama: RMSNorm, SwiGLU, RoPE, GQA (Touvron et al. 2023).")(
    HFFamily(
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        hf.llama_model_config,
        lambda sd, cfg: hf.llama_state_dict(sd, cfg.tie_embeddings),
        _llama_from,
        _llama_layout,
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
        lambda sd, cfg: hf.gpt2_state_dict(sd, cfg.d_model, cfg.tie_embeddings),
        _gpt2_from,
        _untied(hf.gpt2_hf_state_dict),
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
        _llama_layout,
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
        _untied(hf_mixtral.mixtral_checkpoint_state_dict),
    )
)
HF_FAMILIES.register("qwen2", "Qwen2: Llama + q/k/v biases (Yang et al. 2024).")(
    HFFamily(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        hf_mistral.qwen2_model_config,
        lambda sd, cfg: hf_mistral.hf_state_dict(sd, cfg.tie_embeddings),
        _qwen2_from,
        _llama_layout,
    )
)
HF_FAMILIES.register("qwen3", "Qwen3: Llama + QK-norm (Yang et al. 2025).")(
    HFFamily(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        hf_mistral.qwen3_model_config,
        lambda sd, cfg: hf_mistral.hf_state_dict(sd, cfg.tie_embeddings),
        _qwen3_from,
        _llama_layout,
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
        _untied(hf_neox.neox_hf_state_dict),
    )
)
HF_FAMILIES.register("diffllama", "DiffLlama: Llama + differential attention (Ye et al. 2024).")(
    HFFamily(
        "diffllama",
        "DiffLlamaForCausalLM",
        "DiffLlamaConfig",
        hf_diffllama.diffllama_model_config,
        lambda sd, cfg: hf_diffllama.diffllama_state_dict(sd, cfg.tie_embeddings),
        _diffllama_from,
        hf_diffllama.diffllama_hf_state_dict,
    )
)
