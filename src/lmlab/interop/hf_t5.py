"""Hugging Face T5 (``T5ForConditionalGeneration``) <-> lmlab: config map and state-dict maps.

T5 (Raffel et al. 2020): Pre-Norm blocks with T5LayerNorm (RMSNorm, no bias), no biases
anywhere, unscaled attention with a bucketed relative position bias (one table per stack, held
by its first layer), a ReLU MLP (T5) or gated-GELU FFN (T5 v1.1, ``feed_forward_proj:
gated-gelu``), and the decoder output scaled by d_model**-0.5 before a tied LM head. Works on a
config object with ``T5Config``'s attributes and a plain state dict, so lmlab itself never
imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmlab.config import (
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    Seq2SeqConfig,
)
from lmlab.errors import LmlabError
from lmlab.interop.hf_seq2seq import KeyTable, rename, single_id

# T5's dense_act_fn -> lmlab model.ffn.activation ("gated-gelu" means gelu_new, the tanh form)
T5_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "silu": "silu"}


def t5_model_config(hf: Any) -> ModelConfig:
    """A ``T5Config`` (or a config.json namespace) -> ModelConfig (model.kind=encoder_decoder).

    ``feed_forward_proj`` "relu" / "gelu" -> ffn.kind=mlp; "gated-gelu" -> ffn.kind=gated with
    gelu_tanh (HF's gelu_new), "gated-ACT" -> gated with ACT. The decoder output is scaled by
    d_model**-0.5 when ``scale_decoder_outputs`` (transformers >= 5) or, in older configs,
    ``tie_word_embeddings`` says so. ``n_positions`` (default 512) becomes max_seq_len, though
    the relative bias itself has no length limit. Raises LmlabError for an activation lmlab
    lacks.
    """
    proj = str(getattr(hf, "feed_forward_proj", "relu"))
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    act = "gelu_new" if proj == "gated-gelu" else act
    if act not in T5_ACTIVATIONS:
        raise LmlabError(
            f"T5 feed_forward_proj {proj!r} is not supported; activations: "
            f"{', '.join(T5_ACTIVATIONS)}"
        )
    tied = bool(getattr(hf, "tie_word_embeddings", True))
    scale = getattr(hf, "scale_decoder_outputs", None)
    pad = single_id(getattr(hf, "pad_token_id", 0), "pad_token_id")
    start = single_id(getattr(hf, "decoder_start_token_id", None), "decoder_start_token_id")
    return ModelConfig(
        kind="encoder_decoder",
        vocab_size=hf.vocab_size,
        d_model=hf.d_model,
        n_layers=hf.num_layers,
        max_seq_len=int(getattr(hf, "n_positions", None) or 512),
        dropout=float(getattr(hf, "dropout_rate", 0.1)),
        tie_embeddings=tied,
        init="normal",
        attention=AttentionConfig(
            n_heads=hf.num_heads,
            head_dim=hf.d_kv,
            bias=False,
            scaled=False,
            dropout=float(getattr(hf, "dropout_rate", 0.1)),
        ),
        position=PositionConfig(
            kind="t5_relative",
            num_buckets=int(getattr(hf, "relative_attention_num_buckets", 32)),
            max_distance=int(getattr(hf, "relative_attention_max_distance", 128)),
        ),
        norm=NormConfig(kind="rmsnorm", eps=float(getattr(hf, "layer_norm_epsilon", 1e-6))),
        ffn=FFNConfig(
            kind="gated" if gated else "mlp",
            d_ff=hf.d_ff,
            activation=T5_ACTIVATIONS[act],
            bias=False,
        ),
        block=BlockConfig(kind="pre"),
        seq2seq=Seq2SeqConfig(
            n_decoder_layers=getattr(hf, "num_decoder_layers", None) or hf.num_layers,
            pad_token_id=pad,
            decoder_start_token_id=pad if start is None else start,  # T5 starts with pad
            eos_token_id=single_id(getattr(hf, "eos_token_id", 1), "eos_token_id"),
            scale_decoder_output=tied if scale is None else bool(scale),
        ),
    )


def _t5_table(gated: bool) -> KeyTable:
    ffn = (
        [("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")]
        if gated
        else [("wi", "up_proj"), ("wo", "down_proj")]
    )
    attn = [(p, f"{p}_proj") for p in ("q", "k", "v", "o")]
    table: KeyTable = [
        ("shared.weight", "embed.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]
    for stack in ("encoder", "decoder"):
        hf, ours = f"{stack}.block.{{i}}.layer", f"{stack}.layers.{{i}}"
        ff = 2 if stack == "decoder" else 1  # the decoder's FFN follows its cross-attention
        table += [
            (f"{stack}.final_layer_norm.weight", f"{stack}.final_norm.weight"),
            (
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                f"{stack}.position.relative_attention_bias.weight",
            ),
            (f"{hf}.0.layer_norm.weight", f"{ours}.attn_norm.weight"),
            (f"{hf}.{ff}.layer_norm.weight", f"{ours}.ffn_norm.weight"),
        ]
        table += [(f"{hf}.0.SelfAttention.{a}.weight", f"{ours}.attn.{b}.weight") for a, b in attn]
        table += [
            (f"{hf}.{ff}.DenseReluDense.{a}.weight", f"{ours}.ffn.{b}.weight") for a, b in ffn
        ]
    hf, ours = "decoder.block.{i}.layer.1", "decoder.layers.{i}"
    table.append((f"{hf}.layer_norm.weight", f"{ours}.cross_norm.weight"))
    table += [
        (f"{hf}.EncDecAttention.{a}.weight", f"{ours}.cross_attn.{b}.weight") for a, b in attn
    ]
    return table


# tied copies of shared.weight, and a table HF creates but never uses (cross-attention has no bias)
T5_SKIPPED = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)


def t5_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``T5ForConditionalGeneration`` keys -> lmlab's (same layouts, renamed). The encoder's and
    decoder's ``embed_tokens`` (copies of ``shared``) are dropped; with tied embeddings
    ``lm_head.weight`` is the embedding. Raises LmlabError for an unexpected key."""
    kept = {k: v for k, v in sd.items() if k not in T5_SKIPPED}
    out = rename(kept, _t5_table(cfg.ffn.kind == "gated"), reverse=False, family="T5")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def t5_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lmlab keys -> ``T5ForConditionalGeneration``'s: the inverse of :func:`t5_state_dict`,
    writing ``shared``, both ``embed_tokens`` and ``lm_head`` as the model's ``state_dict()``
    lists them. Raises LmlabError for a weight T5 has no place for (a bias, ...), naming it."""
    out = rename(sd, _t5_table(cfg.ffn.kind == "gated"), reverse=True, family="T5")
    if "shared.weight" not in out:
        raise LmlabError("the state dict has no embed.weight")
    out["encoder.embed_tokens.weight"] = out["shared.weight"]
    out["decoder.embed_tokens.weight"] = out["shared.weight"]
    out.setdefault("lm_head.weight", out["shared.weight"])
    return out
