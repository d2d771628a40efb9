"""What a model costs per token: FLOPs, KV-cache bytes, and training memory, from its config.

Nothing is allocated: the model is built on the meta device (:func:`lmlab.models.counting.
meta_model`), N is read from its nn.Linear weights, and what cannot be read from weights is
declared by the variant that knows it: each attention class its score FLOPs and its decoding
cache (``score_flops_per_token``, ``kv_cache_bytes``, ``kv_cache_bytes_per_token``,
``cached_tokens`` in :mod:`lmlab.nn.attention` and :mod:`lmlab.nn.cross_attention`), an MoE
layer the experts a token visits, each model kind its FLOP convention (``flops_per_token``) and
its decoding layers (``cache_attention``).

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

from torch import nn

from lmlab.config import ModelConfig, RunConfig, TrainConfig
from lmlab.errors import LmlabError
from lmlab.models.counting import active_params as _active_params
from lmlab.models.counting import declared, meta_model
from lmlab.training.memory import MemoryEstimate, estimate_training_memory

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


def _model(cfg: ModelConfig) -> nn.Module:
    """The model built on the meta device; the vocabulary (which no cache depends on) may be
    unset."""
    return meta_model(cfg if cfg.vocab_size else dataclasses.replace(cfg, vocab_size=1))


def _counted(cfg: ModelConfig) -> nn.Module:
    """The meta-built model for a FLOP count. Raises LmlabError without vocab_size."""
    if cfg.vocab_size is None:
        raise LmlabError("model.vocab_size must be set to count FLOPs")
    return meta_model(cfg)


def _cache_layers(cfg: ModelConfig) -> tuple[list[nn.Module], list[nn.Module]]:
    """(self-attention modules that decode with a cache, cross-attention modules), as the
    model kind names them (``cache_attention()``, ``cross_cache_attention()``)."""
    model = _model(cfg)
    own = declared(model, "cache_attention")(model)
    cross = getattr(model, "cross_cache_attention", None)
    return list(own), list(cross()) if callable(cross) else []


def decoder_layers(cfg: ModelConfig) -> int:
    """Layers that decode with a KV cache: n_layers for a decoder, the decoder stack's
    (``model.seq2seq.n_decoder_layers``, default n_layers) for an encoder-decoder, 0 for an
    encoder (which reads its input in one pass); the model kind names them."""
    return len(_cache_layers(cfg)[0])


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes one generated token adds to the KV cache: what each decoding layer's attention
    declares (softmax: its key and value, 2 n_kv_heads head_dim dtype_bytes), summed over the
    layers (:func:`decoder_layers`); 0 for an encoder.

    Softmax attention with a sliding window: the same per token, until the cache holds the
    window (see :func:`kv_cache_bytes` for the bounded size). Linear attention: 0, its recurrent
    state has a constant size (:func:`linear_state_bytes`). An encoder-decoder's cross-attention
    cache grows with the source instead: :func:`cross_cache_bytes_per_source_token`.
    """
    own, _ = _cache_layers(cfg)
    return sum(declared(a, "kv_cache_bytes_per_token")(cfg, dtype_bytes) for a in own)


def cross_cache_bytes_per_source_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of an encoder-decoder's cross-attention cache per source token: the key and value
    of the encoder output projected by every decoder layer, computed once before decoding,
    2 * n_decoder_layers * n_kv_heads * head_dim * dtype_bytes (0 for other kinds)."""
    _, cross = _cache_layers(cfg)
    return sum(declared(a, "kv_cache_bytes_per_token")(cfg, dtype_bytes) for a in cross)


def cached_tokens(cfg: ModelConfig, context: int) -> int:
    """Tokens a decoding layer's cache holds while decoding token ``context``, as its attention
    declares: all of them, or at most ``window`` with a sliding window (window - 1 kept between
    steps + the new one); 0 for linear attention's state and for a model that does not decode."""
    own, _ = _cache_layers(cfg)
    return max((declared(a, "cached_tokens")(cfg, context) for a in own), default=0)


def linear_state_bytes(cfg: ModelConfig, batch: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of the constant-size recurrent states, whatever the context: the decoding layers
    whose cache adds nothing per token (linear attention: per layer and sequence
    K * (hd * hd + hd) numbers, Katharopoulos et al. 2020, eq. 10-12); 0 for softmax."""
    own, _ = _cache_layers(cfg)
    constant = [a for a in own if declared(a, "kv_cache_bytes_per_token")(cfg, dtype_bytes) == 0]
    return sum(declared(a, "kv_cache_bytes")(cfg, batch, 1, dtype_bytes) for a in constant)


def kv_cache_bytes(
    cfg: ModelConfig,
    batch: int,
    context: int,
    dtype_bytes: int = 4,
    source_len: int | None = None,
) -> int:
    """Bytes the decoding cache of all layers holds for ``batch`` sequences while decoding
    token ``context``: each decoding layer's declared size (softmax: batch * cached_tokens *
    2 K hd dtype_bytes, bounded by a sliding window; linear attention: its constant recurrent
    state). An encoder-decoder adds its cross-attention cache of a ``source_len``-token source
    (default ``context``): batch * source_len * cross_cache_bytes_per_source_token. An
    encoder: 0."""
    own, cross = _cache_layers(cfg)
    source = context if source_len is None else source_len
    total = sum(declared(a, "kv_cache_bytes")(cfg, batch, context, dtype_bytes) for a in own)
    return total + sum(
        declared(a, "kv_cache_bytes")(cfg, batch, source, dtype_bytes) for a in cross
    )


def kv_cache_bounded(cfg: ModelConfig) -> bool:
    """Whether the decoding cache stops growing with the context (a sliding window, linear
    attention's constant state): its size is the same at 2^40 and 2^41 tokens. False for a
    model that does not decode."""
    if not decoder_layers(cfg):
        return False
    return kv_cache_bytes(cfg, 1, 2**40, 1, 0) == kv_cache_bytes(cfg, 1, 2**41, 1, 0)


def matmul_params(cfg: ModelConfig) -> int:
    """N of the FLOP count: weights a token is multiplied by (see the module docstring), read
    from the built model's nn.Linear weights, L (D H hd + 2 D K hd + H hd D + FFN) + V D; of an
    MoE layer the router and the top_k + shared experts. An encoder: the layers + its MLM head
    (D D + V D). An encoder-decoder: every matmul weight, L encoder layers + n decoder layers
    (with their cross-attention q, k, v, o) + V D. Raises LmlabError without vocab_size."""
    model = _counted(cfg)
    return int(declared(model, "matmul_params")(model))


def encoder_decoder_flops(cfg: ModelConfig, source_len: int, target_len: int) -> int:
    """Forward FLOPs of one (source, target) pair through an encoder-decoder, S = source_len and
    T = target_len tokens, L encoder and n decoder layers, d_attn = H hd:

        S (2 L W + 4 L S d_attn)                   encoder (W: one layer's matmul weights)
      + S 2 n (2 D K hd)                           cross-attention K, V of the encoder output
      + T (2 n (W + 2 D H hd) + 4 n T d_attn      decoder self-attention, FFN, cross q and o,
           + 4 n S d_attn + 2 V D)                 cross-attention scores over S keys, LM head

    (:meth:`lmlab.models.encoder_decoder.EncoderDecoderLM.flops_per_pair` on the meta-built
    model). Raises LmlabError without vocab_size or for a model kind without source and
    target."""
    model = _counted(cfg)
    return int(declared(model, "flops_per_pair")(model, source_len, target_len))


def flops_per_token(
    cfg: ModelConfig, seq_len: int, train: bool = False, mask_prob: float = 0.15
) -> int:
    """FLOPs per token of a forward pass over ``seq_len`` tokens (``train=True``: forward +
    backward = 3 x forward): 2 N + 4 L T (H hd), Kaplan et al. 2020 / PaLM (module docstring),
    as the model kind counts it (its ``flops_per_token``, which the trainer's MFU uses too).

    An encoder: the MLM head at every position forward, at ``mask_prob`` of them in training
    (3 (2 N_layers + 4 L T d_attn) + 3 mask_prob 2 N_head). An encoder-decoder: per source +
    target token of a pair with S = T = seq_len, :func:`encoder_decoder_flops` / (S + T).
    Raises LmlabError when seq_len < 1 or the vocabulary is unknown."""
    if seq_len < 1:
        raise LmlabError(f"seq_len must be >= 1 token, got {seq_len}")
    model = _counted(cfg)
    return int(declared(model, "flops_per_token")(model, seq_len, train, mask_prob))


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token uses (tied weights once): the total, less what the MoE layers leave
    idle, (n_experts - top_k) experts per layer (:meth:`lmlab.nn.moe.MoE.active_params`).
    Mixtral-8x7B: 12.9B of 46.7B. Raises ValueError without vocab_size."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count parameters")
    return _active_params(meta_model(cfg))


def training_memory(
    cfg: ModelConfig, batch: int, seq_len: int, train: TrainConfig | None = None
) -> MemoryEstimate:
    """Peak bytes of training at ``batch`` x ``seq_len`` with AdamW, by term; the estimate of
    :mod:`lmlab.training.memory` (Korthikanti et al. 2022), with ``train``'s precision and
    attention backend (default: TrainConfig(), bf16 autocast)."""
    t = dataclasses.replace(train or TrainConfig(), batch_size=batch, seq_len=seq_len)
    return estimate_training_memory(RunConfig(model=cfg, train=t))
