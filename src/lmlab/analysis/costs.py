"""What a model costs per token: FLOPs, KV-cache bytes, and training memory, from its config alone.

Legend: L n_layers, D d_model, H heads, K kv heads, hd head_dim, F d_ff, V vocab, E experts,
k experts per token (top_k), T sequence length (tokens), b bytes per element.

FLOPs per token (the convention of Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", sec. 2.1, with the attention term as PaLM counts it, Chowdhery et al. 2022, app. B)::

    forward  = 2 N + 4 L T (H hd)
    training = 3 x forward              (the backward pass costs twice the forward)

N is every weight a token is multiplied by: the q/k/v/o projections, the FFN (of an MoE layer
the router, the k routed experts and the shared expert, not the idle ones) and the LM head,
counted even when tied to the embedding (the lookup itself is free); biases, norms and
embedding tables are left out. 4 L T (H hd) is the QK^T and AV products of a token's query
against T keys (2 FLOPs per multiply-add). T is the full sequence length, whatever the mask:
lmlab computes every T x T score and then masks it, as PaLM's and Chinchilla's (Hoffmann et al.
2022, app. F) counts do; a causal query actually needs (t + 1) keys, about half on average.
:func:`flops_per_token` equals :func:`lmlab.training.flops.flops_per_token` (which the trainer's
MFU uses) on the built model; tests check both.

KV cache: each token a softmax-attention layer has seen keeps its key and value, K hd numbers
each, so :func:`kv_cache_bytes_per_token` = 2 L K hd b. With a sliding window the cache stops
growing once it holds the window (at most ``window`` tokens during a decoding step), so
:func:`kv_cache_bytes` is bounded; linear attention keeps a constant-size state instead
(sum phi(k) v^T and sum phi(k): K (hd^2 + hd) numbers per layer) and adds nothing per token.
GQA/MQA shrink the cache by H / K.

Other model kinds (``model.kind``):

- encoder (BERT, Devlin et al. 2019): N is the L layers plus the masked-LM head (dense D x D and
  the V x D projection), the head counted at every position as inference computes it (fill-mask,
  HF BertForMaskedLM); the pooler runs once per sequence on [CLS] and is left out. Training runs
  the head on the masked positions only (``train.mask_prob`` of them, :mod:`lmlab.models.encoder`),
  so training = 3 (2 N_layers + 4 L T (H hd)) + 3 p 2 N_head, not 3 x forward. An encoder reads
  its input in one pass and does not decode: no KV cache (0 bytes).
- encoder_decoder (T5, BART): FLOPs per *source + target* token, i.e. the FLOPs of one
  (source, target) pair of S and T tokens divided by S + T (:func:`encoder_decoder_flops`):
  the encoder's S tokens through L layers with S keys, the cross-attention K/V projections of
  the encoder output (once per source token and decoder layer), and the T target tokens through
  the n decoder layers (self-attention over T keys, cross-attention over S keys, FFN) and the
  LM head; training = 3 x forward. The KV cache per generated token is the decoder's
  self-attention, 2 n K hd b; the cross-attention cache is computed once from the source and
  holds 2 n K hd b per *source* token (:func:`cross_cache_bytes_per_source_token`).
"""

from __future__ import annotations

import dataclasses

from lmlab.analysis.params import count_params, expert_params
from lmlab.config import ModelConfig, RunConfig, TrainConfig
from lmlab.errors import LmlabError
from lmlab.training.memory import GATED_FFNS, MemoryEstimate, estimate_training_memory

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (float32, bfloat16, float16, int8 ...).

    Raises LmlabError for an unknown name, listing the known ones."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise LmlabError(
            f"unknown dtype {name!r}; allowed: {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


def decoder_layers(cfg: ModelConfig) -> int:
    """Layers that decode with a KV cache: n_layers for a decoder, the decoder stack's
    (``model.seq2seq.n_decoder_layers``, default n_layers) for an encoder-decoder, 0 for an
    encoder (which reads its input in one pass)."""
    if cfg.kind == "encoder":
        return 0
    if cfg.kind == "encoder_decoder":
        return cfg.seq2seq.n_decoder_layers or cfg.n_layers
    return cfg.n_layers


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes one generated token adds to the KV cache: its key and value in every decoding layer
    (:func:`decoder_layers`), 2 * layers * n_kv_heads * head_dim * dtype_bytes; 0 for an encoder.

    Softmax attention with a sliding window: the same per token, until the cache holds the
    window (see :func:`kv_cache_bytes` for the bounded size). Linear attention: 0, its recurrent
    state has a constant size (:func:`linear_state_bytes`). An encoder-decoder's cross-attention
    cache grows with the source instead: :func:`cross_cache_bytes_per_source_token`.
    """
    if cfg.attention.kind == "linear":
        return 0
    return 2 * decoder_layers(cfg) * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def cross_cache_bytes_per_source_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of an encoder-decoder's cross-attention cache per source token: the key and value
    of the encoder output projected by every decoder layer, computed once before decoding,
    2 * n_decoder_layers * n_kv_heads * head_dim * dtype_bytes (0 for other kinds)."""
    if cfg.kind != "encoder_decoder":
        return 0
    return 2 * decoder_layers(cfg) * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def cached_tokens(cfg: ModelConfig, context: int) -> int:
    """Tokens a softmax-attention cache holds while decoding token ``context``: all of them, or
    at most ``window`` with a sliding window (window - 1 kept between steps + the new one)."""
    window = cfg.attention.window if cfg.attention.mask == "sliding_window" else None
    return context if window is None else min(context, window)


def linear_state_bytes(cfg: ModelConfig, batch: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of linear attention's recurrent state, whatever the context: per layer and
    sequence K * (hd * hd + hd) numbers (Katharopoulos et al. 2020, eq. 10-12); 0 for softmax."""
    if cfg.attention.kind != "linear":
        return 0
    hd = cfg.head_dim
    return batch * decoder_layers(cfg) * cfg.n_kv_heads * (hd * hd + hd) * dtype_bytes


def kv_cache_bytes(
    cfg: ModelConfig,
    batch: int,
    context: int,
    dtype_bytes: int = 4,
    source_len: int | None = None,
) -> int:
    """Bytes the decoding cache of all layers holds for ``batch`` sequences of ``context``
    tokens: batch * cached_tokens * kv_cache_bytes_per_token (bounded by a sliding window), or
    the constant recurrent state of linear attention. An encoder-decoder adds its
    cross-attention cache of a ``source_len``-token source (default ``context``):
    batch * source_len * cross_cache_bytes_per_source_token. An encoder: 0."""
    if cfg.attention.kind == "linear":
        own = linear_state_bytes(cfg, batch, dtype_bytes)
    else:
        own = batch * cached_tokens(cfg, context) * kv_cache_bytes_per_token(cfg, dtype_bytes)
    source = context if source_len is None else source_len
    return own + batch * source * cross_cache_bytes_per_source_token(cfg, dtype_bytes)


def _ffn_matmul(cfg: ModelConfig, kind: str) -> int:
    return (3 if kind in GATED_FFNS else 2) * cfg.d_model * cfg.d_ff  # (gate,) up, down


def _layer_matmul(cfg: ModelConfig) -> int:
    """One self-attention layer's matmul weights a token meets: q, k, v, o and the FFN (MoE:
    the router and the top_k + shared experts)."""
    d, hd, h, k = cfg.d_model, cfg.head_dim, cfg.attention.n_heads, cfg.n_kv_heads
    per_layer = 2 * d * h * hd + 2 * d * k * hd  # q and o; k and v
    f = cfg.ffn
    if f.kind == "moe":
        active = f.top_k + int(f.shared_expert)
        per_layer += d * f.n_experts + active * _ffn_matmul(cfg, f.expert)  # router + experts
    else:
        per_layer += _ffn_matmul(cfg, f.kind)
    return per_layer


def _mlm_head_matmul(cfg: ModelConfig) -> int:
    """An encoder's masked-LM head: dense D x D and the V x D projection (0 without a head)."""
    assert cfg.vocab_size is not None
    return cfg.d_model * cfg.d_model + cfg.vocab_size * cfg.d_model if cfg.mlm_head else 0


def matmul_params(cfg: ModelConfig) -> int:
    """N of the FLOP count: weights a token is multiplied by (see the module docstring),
    L (D H hd + 2 D K hd + H hd D + FFN) + V D. An encoder: the layers + its MLM head (D D +
    V D). An encoder-decoder: every matmul weight, L encoder layers + n decoder layers (with
    their cross-attention q, k, v, o) + V D. Raises LmlabError without vocab_size."""
    if cfg.vocab_size is None:
        raise LmlabError("model.vocab_size must be set to count FLOPs")
    body = cfg.n_layers * _layer_matmul(cfg)
    if cfg.kind == "encoder":
        return body + _mlm_head_matmul(cfg)
    if cfg.kind == "encoder_decoder":
        d, hd = cfg.d_model, cfg.head_dim
        cross = 2 * d * cfg.attention.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
        body += decoder_layers(cfg) * (_layer_matmul(cfg) + cross)
    return body + cfg.vocab_size * cfg.d_model


def encoder_decoder_flops(cfg: ModelConfig, source_len: int, target_len: int) -> int:
    """Forward FLOPs of one (source, target) pair through an encoder-decoder, S = source_len and
    T = target_len tokens, L encoder and n decoder layers, d_attn = H hd:

        S (2 L W + 4 L S d_attn)                   encoder (W: one layer's matmul weights)
      + S 2 n (2 D K hd)                           cross-attention K, V of the encoder output
      + T (2 n (W + 2 D H hd) + 4 n T d_attn      decoder self-attention, FFN, cross q and o,
           + 4 n S d_attn + 2 V D)                 cross-attention scores over S keys, LM head

    Raises LmlabError without vocab_size."""
    if cfg.vocab_size is None:
        raise LmlabError("model.vocab_size must be set to count FLOPs")
    s, t, L, n = source_len, target_len, cfg.n_layers, decoder_layers(cfg)
    d, hd, h, k = cfg.d_model, cfg.head_dim, cfg.attention.n_heads, cfg.n_kv_heads
    w, d_attn = _layer_matmul(cfg), h * hd
    encoder = s * (2 * L * w + 4 * L * s * d_attn)
    cross_kv = s * 2 * n * (2 * d * k * hd)
    decoder = t * (2 * n * (w + 2 * d * h * hd) + 4 * n * (t + s) * d_attn)
    head = t * 2 * cfg.vocab_size * d
    return encoder + cross_kv + decoder + head


def flops_per_token(
    cfg: ModelConfig, seq_len: int, train: bool = False, mask_prob: float = 0.15
) -> int:
    """FLOPs per token of a forward pass over ``seq_len`` tokens (``train=True``: forward +
    backward = 3 x forward): 2 N + 4 L T (H hd), Kaplan et al. 2020 / PaLM (module docstring).

    An encoder: the MLM head at every position forward, at ``mask_prob`` of them in training
    (3 (2 N_layers + 4 L T d_attn) + 3 mask_prob 2 N_head). An encoder-decoder: per source +
    target token of a pair with S = T = seq_len, :func:`encoder_decoder_flops` / (S + T).
    Raises LmlabError when seq_len < 1 or the vocabulary is unknown."""
    if seq_len < 1:
        raise LmlabError(f"seq_len must be >= 1 token, got {seq_len}")
    if cfg.kind == "encoder_decoder":
        fwd = encoder_decoder_flops(cfg, seq_len, seq_len) // (2 * seq_len)
        return 3 * fwd if train else fwd
    d_attn = cfg.attention.n_heads * cfg.head_dim
    fwd = 2 * matmul_params(cfg) + 4 * cfg.n_layers * seq_len * d_attn
    if cfg.kind == "encoder" and train:
        head = 2 * _mlm_head_matmul(cfg)
        return 3 * (fwd - head) + round(3 * mask_prob * head)
    return 3 * fwd if train else fwd


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token uses (tied weights once): the total, less the experts an MoE layer
    leaves idle, (n_experts - top_k) per layer. Mixtral-8x7B: 12.9B of 46.7B."""
    total = count_params(cfg)["total"]
    f = cfg.ffn
    if f.kind != "moe":
        return total
    return total - cfg.n_layers * (f.n_experts - f.top_k) * expert_params(cfg)


def training_memory(
    cfg: ModelConfig, batch: int, seq_len: int, train: TrainConfig | None = None
) -> MemoryEstimate:
    """Peak bytes of training at ``batch`` x ``seq_len`` with AdamW, by term; the estimate of
    :mod:`lmlab.training.memory` (Korthikanti et al. 2022), with ``train``'s precision and
    attention backend (default: TrainConfig(), bf16 autocast)."""
    t = dataclasses.replace(train or TrainConfig(), batch_size=batch, seq_len=seq_len)
    return estimate_training_memory(RunConfig(model=cfg, train=t))
