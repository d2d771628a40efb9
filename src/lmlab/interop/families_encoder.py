"""The Hugging Face encoder-decoder (T5, BART) and encoder (BERT) families.

An encoder-decoder family stops at its first mismatch (NotRepresentable naming it). Registered in
:data:`lmlab.interop.hf_family.HF_FAMILIES` after the decoder families when
:mod:`lmlab.interop.families` imports this module.
"""

from __future__ import annotations

from typing import Any

from lmlab.config import ModelConfig
from lmlab.interop import hf_bart, hf_bert, hf_t5
from lmlab.interop.hf_family import HF_FAMILIES, HFFamily, NotRepresentable


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
        model_kind="encoder",
    )
)
