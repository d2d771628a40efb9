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
from lmlab.interop import hf, hf_bart, hf_bert, hf_mistral, hf_mixtral, hf_neox, hf_t5
from lmlab.registry import Registry


class NotRepresentable(LmlabError):
    """An lmlab config has components the family's Hugging Face class does not have.

    ``family`` names the family; ``missing`` lists every such component as the dotted config
    setting (e.g. ``model.position.kind=alibi``), so a caller can pick the closest family.
    """

    def __init__(self, family: str, missing: list[str]) -> None:
        self.family, self.missing = family, list(missing)
        super().__init__(f"{family} has no counterpart for {'; '.join(self.missing)}")


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face decoder family: names and the maps both ways.

    ``from_config`` (lmlab config -> the HF config class's kwargs, raising NotRepresentable) and
    ``from_state`` (lmlab state dict -> the tensors of the family's ``model.safetensors``, the
    tied LM head left out as ``save_pretrained`` leaves it out) make ``lmlab export`` possible.
    """

    model_type: str  # config.json "model_type"
    hf_class: str  # transformers class of the LM, e.g. "LlamaForCausalLM"
    hf_config_class: str  # e.g. "LlamaConfig"
    to_config: Callable[[Any], ModelConfig]
    to_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    from_config: Callable[[ModelConfig], dict[str, Any]] | None = None
    from_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]] | None = (
        None
    )
    model_kind: str = "decoder"  # the lmlab model.kind it maps onto

    # Adjusts the config to what the tensors hold (e.g. BERT with or without pooler / MLM head).
    fit_config: Callable[[ModelConfig, dict[str, torch.Tensor]], ModelConfig] | None = None


HF_FAMILIES: Registry[HFFamily] = Registry("hf_family")


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


def _common_checks(cfg: ModelConfig, c: _Checks) -> None:
    """Checks every family here shares: a decoder with softmax attention with the 1/sqrt(hd)
    scale, no v-norm, a final norm, Pre-Norm."""
    a = cfg.attention
    c.require(cfg.kind == "decoder", f"model.kind={cfg.kind}")
    c.require(a.kind == "softmax", f"model.attention.kind={a.kind}")
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


def _llama_checks(cfg: ModelConfig, c: _Checks, ffn: str = "swiglu") -> None:
    """Llama's shape: RMSNorm, ``ffn`` without bias, sequential block, half-split RoPE."""
    _common_checks(cfg, c)
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
    c.require(cfg.tie_embeddings, "model.tie_embeddings=false")
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
        "tie_word_embeddings": True,
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
        lambda sd, cfg: hf.gpt2_state_dict(sd, cfg.d_model),
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


def match_family(cfg: ModelConfig) -> tuple[HFFamily, dict[str, Any]]:
    """The Hugging Face family whose class computes exactly what ``cfg`` does, with its config
    kwargs. Raises NotRepresentable for the closest family (fewest mismatched settings), naming
    each component it has no counterpart for, when none fits."""
    refusals: list[NotRepresentable] = []
    for name in HF_FAMILIES.names():
        family = HF_FAMILIES.get(name)
        if family.from_config is None or family.from_state is None:
            continue
        try:
            return family, family.from_config(cfg)
        except NotRepresentable as e:
            refusals.append(e)
    closest = min(refusals, key=lambda e: len(e.missing))
    err = NotRepresentable(closest.family, closest.missing)
    tried = ", ".join(e.family for e in refusals)
    err.args = (
        f"this model has no Hugging Face counterpart: the closest family, {closest.family}, has "
        f"none for {'; '.join(closest.missing)} (families tried: {tried})",
    )
    raise err


def hf_config_json(family: HFFamily, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an exported model: the family's config kwargs (transformers 5
    keys: RoPE settings in ``rope_parameters``) with ``model_type``, ``architectures`` and the
    float32 ``dtype`` of the written weights."""
    return {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "dtype": "float32",
        **kwargs,
    }


def _require(cond: bool, family: str, what: str) -> None:
    """Seq2seq families stop at their first mismatch."""
    if not cond:
        raise NotRepresentable(family, [what])


def _seq2seq_from(cfg: ModelConfig, family: str) -> None:
    """Checks T5 and BART share: an encoder-decoder with softmax attention, no QK-norm, MHA."""
    a = cfg.attention
    _require(cfg.kind == "encoder_decoder", family, f"model.kind={cfg.kind}")
    _require(a.kind == "softmax" and not a.qk_norm and not a.v_norm, family, "this attention")
    _require(cfg.n_kv_heads == a.n_heads, family, "grouped-query attention")


def _t5_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> T5Config kwargs; raises NotRepresentable naming the first mismatch."""
    _seq2seq_from(cfg, "T5")
    a, f, s = cfg.attention, cfg.ffn, cfg.seq2seq
    _require(cfg.position.kind == "t5_relative", "T5", f"model.position.kind={cfg.position.kind}")
    _require(cfg.norm.kind == "rmsnorm", "T5", f"model.norm.kind={cfg.norm.kind}")
    _require(cfg.block.kind == "pre" and cfg.final_norm, "T5", "this model.block / final_norm")
    _require(not a.bias and not a.out_bias and not a.scaled, "T5", "attention bias or scaling")
    _require(f.kind in ("mlp", "gated") and not f.bias, "T5", "this model.ffn (mlp or gated)")
    acts = {v: k for k, v in hf_t5.T5_ACTIVATIONS.items()}
    _require(f.activation in acts, "T5", f"model.ffn.activation={f.activation}")
    _require(
        not (s.scale_embedding or s.embed_norm or s.final_logits_bias),
        "T5",
        "BART's embedding options",
    )
    # transformers 5 always ties T5's LM head; the scaling is then its own switch
    _require(cfg.tie_embeddings, "T5 (transformers >= 5)", "an untied LM head")
    act = acts[f.activation]
    proj = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if f.kind == "gated" else act
    _require(proj != "gelu_new", "T5", "an ungated gelu_tanh FFN")
    return {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.d_ff,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": s.n_decoder_layers or cfg.n_layers,
        "num_heads": a.n_heads,
        "relative_attention_num_buckets": cfg.position.num_buckets,
        "relative_attention_max_distance": cfg.position.max_distance,
        "dropout_rate": 0.0,
        "layer_norm_epsilon": cfg.norm.eps,
        "feed_forward_proj": proj,
        "tie_word_embeddings": s.scale_decoder_output,  # read by T5Config as the scaling switch
        "pad_token_id": s.pad_token_id if s.pad_token_id is not None else 0,
        "eos_token_id": s.eos_token_id,
        "decoder_start_token_id": s.decoder_start_token_id
        if s.decoder_start_token_id is not None
        else 0,
    }


def _bart_from(cfg: ModelConfig) -> dict[str, Any]:
    """lmlab config -> BartConfig kwargs; raises NotRepresentable naming the first mismatch."""
    _seq2seq_from(cfg, "BART")
    a, f, s, p = cfg.attention, cfg.ffn, cfg.seq2seq, cfg.position
    _require(
        p.kind == "learned" and p.offset == 2, "BART", "this model.position (learned, offset 2)"
    )
    _require(cfg.norm.kind == "layernorm" and cfg.norm.bias, "BART", "this model.norm")
    _require(cfg.norm.eps == 1e-5, "BART", f"model.norm.eps={cfg.norm.eps} (BART: 1e-5)")
    _require(
        cfg.block.kind == "post" and not cfg.final_norm, "BART", "this model.block / final_norm"
    )
    _require(a.bias and a.out_bias in (None, True) and a.scaled, "BART", "this model.attention")
    acts = {v: k for k, v in hf_bart.BART_ACTIVATIONS.items()}
    _require(f.kind == "mlp" and f.bias and f.activation in acts, "BART", "this model.ffn")
    _require(s.embed_norm and s.final_logits_bias, "BART", "no embedding norm / logits bias")
    _require(not s.scale_decoder_output, "BART", "model.seq2seq.scale_decoder_output")
    _require(cfg.tie_embeddings, "BART", "an untied LM head")
    return {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": s.n_decoder_layers or cfg.n_layers,
        "encoder_attention_heads": a.n_heads,
        "decoder_attention_heads": a.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": acts[f.activation],
        "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": s.scale_embedding,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "pad_token_id": s.pad_token_id if s.pad_token_id is not None else 1,
        "bos_token_id": None,
        "eos_token_id": s.eos_token_id,
        "decoder_start_token_id": s.decoder_start_token_id
        if s.decoder_start_token_id is not None
        else 2,
        "forced_eos_token_id": None,
    }


HF_FAMILIES.register("t5", "T5: RMSNorm, relative position bias, encoder-decoder (Raffel 2020).")(
    HFFamily(
        "t5",
        "T5ForConditionalGeneration",
        "T5Config",
        hf_t5.t5_model_config,
        hf_t5.t5_state_dict,
        _t5_from,
        model_kind="encoder_decoder",
    )
)
HF_FAMILIES.register("bart", "BART: Post-Norm, learned positions, encoder-decoder (Lewis 2020).")(
    HFFamily(
        "bart",
        "BartForConditionalGeneration",
        "BartConfig",
        hf_bart.bart_model_config,
        hf_bart.bart_state_dict,
        _bart_from,
        model_kind="encoder_decoder",
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
