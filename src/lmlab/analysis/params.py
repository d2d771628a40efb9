"""Parameter counts from a config alone, without building the model.

So the real sizes of the presets (GPT-2 small, Llama-3-8B, Mixtral-8x7B ...) can be inspected on
a laptop: the counts are closed-form in d_model (D), n_layers (L), n_heads (H), n_kv_heads (K),
head_dim (hd), d_ff (F), vocab_size (V) and n_experts (E), and tests check them against
``sum(p.numel())`` of built models for every registered variant. Tied weights count once.
"""

from __future__ import annotations

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


def attention_params_by_part(cfg: ModelConfig) -> dict[str, int]:
    """One layer's attention by part: ``q``, ``k``, ``v``, ``o`` (weights + biases) and ``norms``
    (QK-norm / V-norm RMSNorm weights over head_dim; HybridNorm turns both on)."""
    a, d, hd = cfg.attention, cfg.d_model, cfg.head_dim
    h, k = a.n_heads, cfg.n_kv_heads
    out_bias = a.bias if a.out_bias is None else a.out_bias
    hybrid = cfg.block.kind == "hybrid"
    return {
        "q": _linear(d, h * hd, a.bias),
        "k": _linear(d, k * hd, a.bias),
        "v": _linear(d, k * hd, a.bias),
        "o": _linear(h * hd, d, out_bias),
        "norms": (2 * hd if (a.qk_norm or hybrid) else 0) + (hd if (a.v_norm or hybrid) else 0),
    }


def attention_params(cfg: ModelConfig) -> int:
    """One layer's q, k, v, o projections (+ biases) and QK/V-norm weights."""
    return sum(attention_params_by_part(cfg).values())


def expert_params(cfg: ModelConfig) -> int:
    """One MoE expert (the dense FFN named by ``model.ffn.expert``, d_ff wide)."""
    return _dense_ffn(cfg, cfg.ffn.expert)


def ffn_params(cfg: ModelConfig) -> int:
    """One layer's FFN; for MoE all experts, the router and the shared expert."""
    f = cfg.ffn
    if f.kind != "moe":
        return _dense_ffn(cfg, f.kind)
    return cfg.d_model * f.n_experts + expert_params(cfg) * (f.n_experts + int(f.shared_expert))


def position_params(cfg: ModelConfig) -> int:
    """One position module: a learned (max_seq_len + offset, D) table or T5's (buckets, H)."""
    if cfg.position.kind == "learned":
        return (cfg.max_seq_len + cfg.position.offset) * cfg.d_model
    if cfg.position.kind == "t5_relative":
        return cfg.position.num_buckets * cfg.attention.n_heads
    return 0


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component, plus ``total`` and ``non_embedding`` (total minus the token
    embedding; a tied LM head is the same matrix). Raises ValueError without vocab_size."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count parameters")
    L, d, v = cfg.n_layers, cfg.d_model, cfg.vocab_size
    norms_per_layer = 1 if cfg.block.kind == "hybrid" else 2
    parts = {
        "embedding": v * d,
        "position": position_params(cfg),
        "attention": L * attention_params(cfg),
        "ffn": L * ffn_params(cfg),
        "norms": L * norms_per_layer * _norm(cfg) + (_norm(cfg) if cfg.final_norm else 0),
        "lm_head": 0 if cfg.tie_embeddings else v * d,
    }
    if cfg.kind == "encoder_decoder":  # T5 / BART: a second stack with cross-attention
        s, n = cfg.seq2seq, cfg.seq2seq.n_decoder_layers or L
        stack_norms = 2 * (_norm(cfg) if s.embed_norm else 0) + 2 * (
            _norm(cfg) if cfg.final_norm else 0
        )
        parts["position"] *= 2  # the encoder's table and the decoder's
        parts["attention"] += 2 * n * attention_params(cfg)  # self- and cross-attention
        parts["ffn"] += n * ffn_params(cfg)
        parts["norms"] = (2 * L + 3 * n) * _norm(cfg) + stack_norms
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
