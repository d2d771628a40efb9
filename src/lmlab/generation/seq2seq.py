"""Sequence-to-sequence generation: encode the sources once, then decode token by token.

Legend: B sources, S source tokens (right-padded), T decoder tokens, V vocab. Works on token ids
(tokenizer-agnostic). Every row starts from ``model.seq2seq.decoder_start_token_id`` at decoder
position 0, so a batch needs no decoder padding: rows that reached EOS keep being fed a
placeholder whose outputs are ignored. With the cache, each step feeds one token per row; the
decoder self-attention keys/values grow in the cache and the cross-attention keys/values of the
encoder output are projected once, on the first step (:class:`EncoderDecoderCache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.generation.generate import SamplingParams, _generator
from lmlab.generation.sampling import next_token
from lmlab.generation.stream import token_text

if TYPE_CHECKING:
    from lmlab.data.tokenizer import Tokenizer


def _special(model: nn.Module, name: str) -> int | None:
    value = getattr(model.cfg.seq2seq, name)  # type: ignore[union-attr]
    return None if value is None else int(value)


def _check(model: nn.Module, sources: list[list[int]], params: SamplingParams) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.kind != "encoder_decoder":
        kind = getattr(cfg, "kind", type(model).__name__)
        raise LmlabError(
            f"seq2seq generation needs an encoder-decoder model (model.kind=encoder_decoder), "
            f"got {kind}"
        )
    params.validate()
    if params.stop:
        raise LmlabError("stop strings need a tokenizer; generate_seq2seq works on token ids")
    if not sources or any(len(s) == 0 for s in sources):
        raise LmlabError("every source needs at least one token")
    longest = max(len(s) for s in sources)
    if longest > cfg.max_seq_len:
        raise LmlabError(
            f"a source of {longest} tokens is longer than the encoder context "
            f"(model.max_seq_len={cfg.max_seq_len})"
        )
    bad = [t for s in sources for t in s if not 0 <= t < cfg.vocab_size]
    if bad:
        raise LmlabError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if _special(model, "decoder_start_token_id") is None:
        raise LmlabError("model.seq2seq.decoder_start_token_id is not set")


@torch.no_grad()
def generate_seq2seq(
    model: nn.Module,
    sources: list[list[int]],
    params: SamplingParams | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Generate a target for each source (token ids) with an encoder-decoder model.

    Sources are right-padded into one batch with an attention mask. Each row samples with
    ``params`` (temperature 0 = greedy; top-k, top-p and repetition penalty as
    :func:`lmlab.generation.sampling.next_token`; row i's generator is seeded with seed + i)
    and stops at ``model.seq2seq.eos_token_id`` (not returned) or after ``max_new_tokens``,
    capped so the decoder input (start token + generated) fits ``model.max_seq_len``.
    ``use_cache=False`` re-runs the whole decoder each step (same tokens, for testing).

    Returns one list of generated ids per source, without the start token and the EOS. Raises
    LmlabError for a decoder-only model, an empty or too long source, an id outside the
    vocabulary, an unset decoder start id or stop strings (which need a tokenizer).
    """
    params = params or SamplingParams()
    _check(model, sources, params)
    start = _special(model, "decoder_start_token_id")
    assert start is not None  # _check raised otherwise
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    eos = _special(model, "eos_token_id")
    pad = _special(model, "pad_token_id")
    filler = start if pad is None else pad  # fed to finished rows; their outputs are unused
    device = next(model.parameters()).device
    b, s = len(sources), max(len(x) for x in sources)
    src = torch.tensor([x + [filler] * (s - len(x)) for x in sources], device=device)  # (B, S)
    mask = torch.tensor([[1] * len(x) + [0] * (s - len(x)) for x in sources], device=device)
    was_training = model.training
    model.eval()
    try:
        memory = model.encode(src, mask)  # type: ignore[operator]  # (B, S, D)
        n_new = min(params.max_new_tokens, cfg.max_seq_len - 1)
        gens = [_generator(params.seed, i) for i in range(b)]
        dec = torch.full((b, 1), start, dtype=torch.long, device=device)  # (B, T)
        cache = model.new_cache() if use_cache else None  # type: ignore[operator]
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        for _ in range(n_new):
            x = dec[:, -1:] if cache is not None else dec
            logits = model(
                attention_mask=mask,
                decoder_input_ids=x,
                cache=cache,
                encoder_hidden_states=memory,
                last_only=True,
            ).logits[:, -1]  # (B, V)
            step = []
            for i in range(b):
                tok = filler
                if not done[i]:
                    tok = next_token(
                        logits[i],
                        dec[i],
                        params.temperature,
                        params.top_k,
                        params.top_p,
                        params.repetition_penalty,
                        gens[i],
                    )
                    if tok == eos:
                        done[i] = True
                    else:
                        out[i].append(tok)
                step.append(tok)
            if all(done):
                break
            dec = torch.cat([dec, torch.tensor(step, device=device)[:, None]], dim=1)
        return out
    finally:
        model.train(was_training)


def generate_from_sources(
    model: nn.Module, tokenizer: Tokenizer | None, sources: list[str], params: SamplingParams
) -> list[str]:
    """Texts in, texts out: each source encoded as the model reads it (``encode_for_model``: a
    Hugging Face T5 tokenizer appends ``</s>``), generated with :func:`generate_seq2seq` and
    decoded. Raises LmlabError for a model that is not an encoder-decoder, a missing tokenizer,
    an empty source or one longer than the encoder context (model.max_seq_len)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.kind != "encoder_decoder":
        kind = getattr(cfg, "kind", type(model).__name__)
        raise LmlabError(
            f"--source needs an encoder-decoder (seq2seq) model, this one is model.kind={kind}: "
            "use --prompt TEXT to continue a text"
        )
    if tokenizer is None:
        raise LmlabError(
            "this model has no tokenizer (no tokenizer.json), so --source cannot be encoded"
        )
    ids = []
    for text in sources:
        x = tokenizer.encode_for_model(text)
        if not text or not x:
            raise LmlabError(f"--source {text!r} encodes to no tokens")
        if len(x) > cfg.max_seq_len:
            raise LmlabError(
                f"--source is {len(x)} tokens, longer than the encoder context of "
                f"{cfg.max_seq_len} tokens (model.max_seq_len); shorten it"
            )
        ids.append(x)
    return [_text(tokenizer, out) for out in generate_seq2seq(model, ids, params)]


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Generated ids -> text of whole characters (:func:`lmlab.generation.stream.token_text`):
    no replacement character for a character cut by ``max_new_tokens``."""
    pieces = token_text(tokenizer)
    return "".join(pieces.push(i) for i in ids) + pieces.flush()
