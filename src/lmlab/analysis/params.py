"""Parameter counts from a config alone, without building the model.

So the real sizes of the presets (GPT-2 small, Llama-3-8B, Mixtral-8x7B ...) can be inspected on
a laptop: the counts are closed-form in d_model (D), n_layers (L), n_heads (H), n_kv_heads (K),
head_dim (hd), d_ff (F), vocab_size (V) and n_experts (E), and tests check them against
``sum(p.numel())`` of built models for every registered variant. Tied weights count once.
"""

from __future__ import annotations

from typing import Any

from lmlab.config import ModelConfig


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _norm(cfg: ModelConfig, dim: int | None = None) -> int:
    d = dim or cfg.d_model
    return 2 * d if cfg.norm.kind == "layernorm" and cfg.norm.bias else d


def _dense_ffn(cfg: ModelConfig, kind: str) -> int:
    d, f, bias = cfg.d_model, cfg.d_ff, cfg.ffn.bias
    if kind == "mlp":
        return _linear(d, f, bias) + _linear(f, d, bias)
    return 2 * _linear(d, f, bias) + _linear(f, d, bias)  # swiglu / geglu: gate, up, down


def attention_params(cfg: ModelConfig) -> int:
    """One layer's q, k, v, o projections (+ biases) and QK/V-norm weights."""
    a, d, hd = cfg.attention, cfg.d_model, cfg.head_dim
    h, k = a.n_heads, cfg.n_kv_heads
    out_bias = a.bias if a.out_bias is None else a.out_bias
    n = _linear(d, h * hd, a.bias) + 2 * _linear(d, k * hd, a.bias) + _linear(h * hd, d, out_bias)
    hybrid = cfg.block.kind == "hybrid"
    n += 2 * hd if (a.qk_norm or hybrid) else 0  # RMSNorm weights over head_dim
    n += hd if (a.v_norm or hybrid) else 0
    return n


def ffn_params(cfg: ModelConfig) -> int:
    """One layer's FFN; for MoE all experts, the router and the shared expert."""
    f = cfg.ffn
    if f.kind != "moe":
        return _dense_ffn(cfg, f.kind)
    expert = _dense_ffn(cfg, f.expert)
    return cfg.d_model * f.n_experts + expert * (f.n_experts + int(f.shared_expert))


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component, plus ``total`` and ``non_embedding`` (total minus the token
    embedding; a tied LM head is the same matrix). Raises ValueError without vocab_size."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count parameters")
    L, d, v = cfg.n_layers, cfg.d_model, cfg.vocab_size
    norms_per_layer = 1 if cfg.block.kind == "hybrid" else 2
    parts = {
        "embedding": v * d,
        "position": cfg.max_seq_len * d if cfg.position.kind == "learned" else 0,
        "attention": L * attention_params(cfg),
        "ffn": L * ffn_params(cfg),
        "norms": L * norms_per_layer * _norm(cfg) + (_norm(cfg) if cfg.final_norm else 0),
        "lm_head": 0 if cfg.tie_embeddings else v * d,
    }
    if cfg.kind == "encoder":  # BERT: segments, embedding norm, pooler, MLM head (Devlin 2019)
        post = cfg.block.kind == "post"
        final = _norm(cfg) if cfg.final_norm and not post else 0
        parts["norms"] = L * norms_per_layer * _norm(cfg) + _norm(cfg) + final
        parts["token_type"] = cfg.type_vocab_size * d
        parts["pooler"] = _linear(d, d, True) if cfg.pooler else 0
        head = _linear(d, d, True) + _norm(cfg) + v if cfg.mlm_head else 0
        parts["lm_head"] = head + (v * d if cfg.mlm_head and not cfg.tie_embeddings else 0)
    parts["total"] = sum(parts.values())
    parts["non_embedding"] = parts["total"] - parts["embedding"]
    return parts


def inspect_config(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Parameter counts of a config file or run folder (nothing is built or allocated).

    Returns ``{"name", "vocab_size", "vocab_note", "params_total", "params_non_embedding",
    "components"}``. A char-level config has no vocabulary until trained: it is counted with
    256 symbols and says so in ``vocab_note`` (override with ``model.vocab_size=N``).
    """
    from pathlib import Path

    from lmlab.config import load_config

    p = Path(path)
    cfg = load_config(p / "config.yaml" if p.is_dir() else p, overrides)
    note = ""
    if cfg.model.vocab_size is None:
        tok = cfg.data.tokenizer
        cfg.model.vocab_size = tok.vocab_size if tok.kind in ("bpe", "wordlevel") else 256
        note = f"vocab_size not set: counted with the {tok.kind} tokenizer's {cfg.model.vocab_size}"
    parts = count_params(cfg.model)
    components = {k: v for k, v in parts.items() if k not in ("total", "non_embedding")}
    return {
        "name": cfg.name,
        "vocab_size": cfg.model.vocab_size,
        "vocab_note": note,
        "params_total": parts["total"],
        "params_non_embedding": parts["non_embedding"],
        "components": components,
    }
