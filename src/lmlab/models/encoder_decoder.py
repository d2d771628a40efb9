"""Encoder-decoder Transformer (Vaswani et al. 2017; T5, Raffel et al. 2020; BART, Lewis et al.
2020): the encoder reads the source bidirectionally, the decoder generates the target causally
and reads the encoder output through cross-attention in every layer.

Legend: B batch, S source tokens, T decoder tokens (new ones; cached + new when cached), D
d_model, H heads, V vocab_size. The encoder and the decoder share the token embedding (and the
LM head when ``tie_embeddings``); each has its own position module (T5: its own relative-bias
table with bidirectional / causal buckets; BART: its own learned table). Encoder layers are the
:data:`~lmlab.nn.block.BLOCK` of ``model.block.kind`` with a bidirectional mask; decoder layers
the :data:`~lmlab.nn.block.DECODER_BLOCK` of the same kind (self-attention, cross-attention, FFN).

Training on (source, target) pairs: ``model(input_ids=src, attention_mask=src_mask,
targets=tgt)`` where ``tgt`` ends with EOS and is padded with -100; the decoder input is
``tgt`` shifted right behind ``model.seq2seq.decoder_start_token_id`` (:meth:`shift_right`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.checks import choice, positive
from lmlab.config import ModelConfig
from lmlab.errors import ConfigError, LmlabError
from lmlab.models.counting import matmul_params, num_params, score_flops
from lmlab.models.init import init_weights
from lmlab.models.output import ModelOutput
from lmlab.models.stack import LayerStack, StackOutput, padding_mask
from lmlab.models.tying import TiedEmbeddingsModule
from lmlab.nn.block import BLOCK, DECODER_BLOCK
from lmlab.nn.hooks import HookPoint, fast_hook_lookup
from lmlab.nn.kv_cache import EncoderDecoderCache
from lmlab.nn.norm import build_norm
from lmlab.nn.position import POSITION


@dataclass
class Seq2SeqOutput(ModelOutput):
    """:class:`ModelOutput` of an encoder-decoder. ``logits`` (B, T, V), ``loss``, ``cache`` (an
    :class:`EncoderDecoderCache`), ``hidden_states`` and ``attentions`` are the decoder's
    (self-attention weights (B, H, T, T_total)). Added:

    cross_attentions: per decoder layer, (B, H, T, S) weights of each decoder token over the
    source tokens (rows sum to 1 over real source tokens) when ``need_weights``;
    encoder_last_hidden_state: (B, S, D), the encoder output (None when a filled cache made the
    encoder unnecessary); encoder_hidden_states: the encoder's residual stream entering each
    layer plus its output; encoder_attentions: per encoder layer (B, H, S, S).
    """

    cross_attentions: list[torch.Tensor | None] = field(default_factory=list)
    encoder_last_hidden_state: torch.Tensor | None = None
    encoder_hidden_states: list[torch.Tensor] = field(default_factory=list)
    encoder_attentions: list[torch.Tensor | None] = field(default_factory=list)


class Seq2SeqStack(nn.Module):
    """Positions -> embedding norm -> dropout -> N blocks -> final norm: the encoder (bidirectional
    :data:`~lmlab.nn.block.BLOCK` blocks) or, with ``decoder``, the decoder (causal
    :data:`~lmlab.nn.block.DECODER_BLOCK` blocks reading the encoder output)."""

    def __init__(self, cfg: ModelConfig, decoder: bool) -> None:
        super().__init__()
        mask = "causal" if decoder else "bidirectional"
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, mask=mask))
        n = (cfg.seq2seq.n_decoder_layers or cfg.n_layers) if decoder else cfg.n_layers
        self.position = POSITION.get(cfg.position.kind, "model.position.kind")(cfg)
        self.embed_norm = build_norm(cfg) if cfg.seq2seq.embed_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        block_cls = (DECODER_BLOCK if decoder else BLOCK).get(cfg.block.kind, "model.block.kind")
        self.layers = LayerStack([block_cls(cfg, i) for i in range(n)], cross=decoder)
        self.final_norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.hook_embed = HookPoint()  # (B, T, D) token embedding (x embed_scale)
        self.hook_final_norm = HookPoint()  # (B, T, D) the final norm's output

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output (B, T, D), through ``hook_final_norm``."""
        return self.hook_final_norm(self.final_norm(x))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        need_weights: bool,
        hidden: bool,
        cache: EncoderDecoderCache | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> StackOutput:
        """Token embeddings (B, T, D) at ``positions`` (T,) -> :class:`StackOutput` (output
        (B, T, D), hidden states, self-attention and, in the decoder, cross-attention weights).
        ``memory`` (B, S, D) and ``memory_mask`` (B, S): the encoder output and its padding."""
        x = self.drop(self.embed_norm(self.position.embed(self.hook_embed(x), positions)))
        return self.layers(
            x, self.position, positions, key_mask, cache, need_weights, hidden, self.normed,
            memory, memory_mask,
        )  # fmt: skip


class Seq2SeqEncoder(Seq2SeqStack):
    """The encoder: bidirectional blocks over the source."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, decoder=False)


class Seq2SeqDecoder(Seq2SeqStack):
    """The decoder: causal blocks with cross-attention over the encoder output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, decoder=True)


class EncoderDecoderLM(TiedEmbeddingsModule):
    """A sequence-to-sequence Transformer: T5-style (Pre-Norm, RMSNorm, relative position bias,
    unscaled attention) or BART-style (Post-Norm, LayerNorm, learned positions) by config."""

    final_logits_bias: torch.Tensor | None
    options = ("seq2seq",)

    @staticmethod
    def check(m: ModelConfig) -> None:
        """model.seq2seq's ids in the vocabulary; pre or post blocks (not parallel), softmax
        attention with a causal decoder mask, a dense FFN; seq2seq.scale_embedding, not
        model.scale_embedding."""
        if m.scale_embedding is not None:
            raise ConfigError(
                "model.scale_embedding applies to kind=decoder and encoder; an encoder_decoder "
                "sets model.seq2seq.scale_embedding"
            )
        s = m.seq2seq
        positive(s.n_decoder_layers, "model.seq2seq.n_decoder_layers")
        for name in ("pad_token_id", "decoder_start_token_id", "eos_token_id"):
            value = getattr(s, name)
            positive(value, f"model.seq2seq.{name}", allow_zero=True)
            if value is not None and m.vocab_size is not None and value >= m.vocab_size:
                raise ConfigError(
                    f"model.seq2seq.{name} ({value}) must be < model.vocab_size ({m.vocab_size})"
                )
        choice(m.block.kind, DECODER_BLOCK.names(), "model.block.kind (encoder_decoder)")
        if m.block.parallel:
            raise ConfigError("model.block.parallel is not supported by model.kind=encoder_decoder")
        choice(m.attention.kind, ["softmax"], "model.attention.kind (encoder_decoder)")
        choice(
            m.attention.mask, ["causal"], "model.attention.mask (encoder_decoder: the decoder's)"
        )
        choice(m.ffn.kind, ["mlp", "swiglu", "geglu", "gated"], "model.ffn.kind")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise LmlabError("model.vocab_size is not set (it normally comes from the tokenizer)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.seq2seq.scale_embedding else 1.0
        self.encoder = Seq2SeqEncoder(cfg)
        self.decoder = Seq2SeqDecoder(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # T5 with tied embeddings rescales the decoder output before the shared matrix
        self.output_scale = cfg.d_model**-0.5 if cfg.seq2seq.scale_decoder_output else 1.0
        bias = torch.zeros(1, cfg.vocab_size) if cfg.seq2seq.final_logits_bias else None
        self.register_buffer("final_logits_bias", bias)  # BART: a fixed (1, V) logit offset
        self.hook_logits = HookPoint()  # (B, T, V) decoder logits (lmlab.hooks)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.tie_embeddings()  # lm_head.weight is embed.weight, through every load too
        fast_hook_lookup(self)  # hook points named, one dict lookup each

    def reset_parameters(self) -> None:
        """Initialise every weight with the scheme named by ``model.init``, residual projections
        zeroed under ``model.init_zero_residual`` (:func:`lmlab.models.init.init_weights`)."""
        init_weights(self, self.cfg)

    # ------------------------------------------------------------------------------ helpers

    def _special(self, name: str) -> int:
        value = getattr(self.cfg.seq2seq, name)
        if value is None:
            raise LmlabError(f"model.seq2seq.{name} is not set (the tokenizer normally gives it)")
        return int(value)

    def shift_right(self, targets: torch.Tensor) -> torch.Tensor:
        """Target ids (B, T) int64 (-100 = ignored) -> decoder input ids (B, T): the
        decoder start token, then targets[:, :-1] with -100 replaced by the pad id (teacher
        forcing: position t reads target t-1 and predicts target t). Raises LmlabError when
        ``model.seq2seq.decoder_start_token_id`` or ``pad_token_id`` is unset."""
        start, pad = self._special("decoder_start_token_id"), self._special("pad_token_id")
        shifted = torch.full_like(targets, start)
        shifted[:, 1:] = targets[:, :-1]
        return shifted.masked_fill(shifted == -100, pad)

    def _check_length(self, n: int, side: str) -> None:
        if n > self.cfg.max_seq_len:
            raise LmlabError(
                f"the {side} has {n} tokens, more than the context model.max_seq_len="
                f"{self.cfg.max_seq_len}"
            )

    def new_cache(self) -> EncoderDecoderCache:
        """An empty cache: one self-attention cache per decoder layer and one cross-attention
        cache per decoder layer (filled on the first call with the encoder output)."""
        attns: list = [layer.attn for layer in self.decoder.layers]
        return EncoderDecoderCache([attn.new_cache() for attn in attns])

    # ------------------------------------------------------------------------------ passes

    def _encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        need_weights: bool = False,
        hidden: bool = False,
    ) -> StackOutput:
        b, s = input_ids.shape
        self._check_length(s, "source")
        key_mask = padding_mask(attention_mask, (b, s), "attention_mask", "(B, S)")
        x = self.embed(input_ids) * self.embed_scale  # (B, S, D)
        return self.encoder(x, torch.arange(s, device=x.device), key_mask, need_weights, hidden)

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Source ids (B, S) int64, attention_mask (B, S) (1 = real token, 0 = padding) -> the
        encoder output (B, S, D). Raises LmlabError for a source longer than max_seq_len."""
        return self._encode(input_ids, attention_mask).x

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        last_only: bool = False,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> Seq2SeqOutput:
        """Source ids (B, S) and decoder ids (B, T) int64 -> Seq2SeqOutput, logits (B, T, V)
        (or (B, 1, V) with ``last_only``).

        attention_mask (B, S): 1 = real source token, 0 = padding (hidden from the encoder's
        self-attention and from every cross-attention). targets (B, T) int64, -100 ignored: the
        loss is the mean cross-entropy in nats/token (float32); without ``decoder_input_ids``
        they are :meth:`shift_right` ed into them. decoder_attention_mask (B, cached + T): 1 =
        real decoder token (the causal mask applies anyway). ``cache``: from :meth:`new_cache`;
        the first call fills its cross-attention part from the encoder output, later calls
        need only ``decoder_input_ids`` (the source is neither needed nor re-encoded).
        ``encoder_hidden_states`` (B, S, D): an encoder output computed earlier (skips the
        encoder). Raises LmlabError without decoder inputs or a source, ValueError for a mask
        of the wrong shape.
        """
        if decoder_input_ids is None:
            if targets is None:
                raise LmlabError("an encoder-decoder forward needs decoder_input_ids or targets")
            decoder_input_ids = self.shift_right(targets)
        enc: StackOutput | None = None  # the encoder's pass, when this call runs it
        memory = encoder_hidden_states
        source_mask = None if attention_mask is None else attention_mask.bool()
        if cache is not None and cache.cross_filled:
            source_mask = cache.source_mask  # the cross-attention K/V already hold the source
        elif memory is None:
            if input_ids is None:
                raise LmlabError("an encoder-decoder forward needs input_ids (the source)")
            enc = self._encode(input_ids, attention_mask, need_weights, output_hidden_states)
            memory = enc.x
        if cache is not None and not cache.cross_filled:
            cache.source_mask = source_mask

        dec = self._decode(
            decoder_input_ids, memory, source_mask, decoder_attention_mask, cache, need_weights,
            output_hidden_states,
        )  # fmt: skip
        x = dec.x
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(x * self.output_scale)  # (B, T, V)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        logits = self.hook_logits(logits)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        return Seq2SeqOutput(
            logits,
            loss,
            cache,
            dec.hidden_states,
            dec.attentions,
            cross_attentions=dec.cross_attentions,
            encoder_last_hidden_state=memory,
            encoder_hidden_states=enc.hidden_states if enc is not None else [],
            encoder_attentions=enc.attentions if enc is not None else [],
        )

    def _decode(
        self,
        ids: torch.Tensor,
        memory: torch.Tensor | None,
        source_mask: torch.Tensor | None,
        decoder_attention_mask: torch.Tensor | None,
        cache: EncoderDecoderCache | None,
        need_weights: bool,
        hidden: bool,
    ) -> StackOutput:
        """Decoder ids (B, T) -> the decoder's :class:`StackOutput` (final hidden (B, T, D),
        hidden states, self and cross weights)."""
        b, t = ids.shape
        past = cache.seq_len if cache is not None else 0
        self._check_length(past + t, "decoder input")
        key_mask = padding_mask(
            decoder_attention_mask, (b, past + t), "decoder_attention_mask",
            "(B, cached + new tokens)",
        )  # fmt: skip
        positions = torch.arange(past, past + t, device=ids.device)  # (T,)
        x = self.embed(ids) * self.embed_scale  # (B, T, D)
        return self.decoder(
            x, positions, key_mask, need_weights, hidden, cache, memory, source_mask
        )

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (tied weights counted once); ``non_embedding`` leaves out the
        token embedding (and a tied LM head, which is the same matrix)."""
        return num_params(self, non_embedding)

    # ------------------------------------------------------------------ what it costs
    flops_convention = (
        "per source + target token: the FLOPs of a (source, target) pair of seq_len tokens "
        "each, divided by 2 seq_len; training = 3 x forward"
    )

    def cache_attention(self) -> list[nn.Module]:
        """The decoder's self-attention modules, whose state :meth:`new_cache` holds."""
        return [layer.attn for layer in self.decoder.layers]  # type: ignore[misc]

    def cross_cache_attention(self) -> list[nn.Module]:
        """The decoder's cross-attention modules (their cache grows with the source)."""
        return [layer.cross_attn for layer in self.decoder.layers]  # type: ignore[misc]

    def matmul_params(self) -> int:
        """N: every matmul weight, L encoder + n decoder layers (with cross-attention) + V D."""
        return matmul_params(self)

    def flops_per_pair(self, source_len: int, target_len: int) -> int:
        """Forward FLOPs of one (source, target) pair, S and T tokens: the encoder over S
        tokens with S keys, the cross-attention K/V of the encoder output (once per source
        token), the decoder over T tokens (self-attention over T keys, cross-attention over S)
        and the LM head (lmlab.analysis.costs.encoder_decoder_flops)."""
        s, t, cfg = source_len, target_len, self.cfg
        cross = self.cross_cache_attention()
        memory_w = sum(c.memory_matmul_params() for c in cross)  # type: ignore[operator]
        enc_attns = [layer.attn for layer in self.encoder.layers]
        encoder = s * (2 * matmul_params(self.encoder) + score_flops(enc_attns, cfg, s))  # type: ignore[arg-type]
        self_scores = score_flops(self.cache_attention(), cfg, t)
        decoder = 2 * (matmul_params(self.decoder) - memory_w) + self_scores
        decoder += score_flops(cross, cfg, s)
        return encoder + s * 2 * memory_w + t * (decoder + 2 * matmul_params(self.lm_head))

    def flops_per_token(self, seq_len: int, train: bool = False, mask_prob: float = 0.15) -> int:
        """FLOPs per source + target token of a pair with S = T = ``seq_len``:
        :meth:`flops_per_pair` / (S + T); ``train``: 3 x forward (``mask_prob`` unused)."""
        fwd = self.flops_per_pair(seq_len, seq_len) // (2 * seq_len)
        return 3 * fwd if train else fwd
