"""The decode loop: prefill the prompt once, then one cached step per new token.

Legend: B prompts, S cached slots (padding included), V vocab. Several prompts decode as one
left-padded batch (:func:`generate_batch`): an attention mask hides the padding and positions
come from the mask, so each row generates what it would alone; one prompt is a batch of one.
When a row's context fills up, the cache is rebuilt from its last 3/4 of ``max_seq_len``
tokens, so generation can run past the window without ever attending beyond it; a streaming
cache (bounded, positions with no table limit) just keeps going.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import LmlabError
from lmlab.generation import lean_step
from lmlab.generation.sampling import check_sampling, next_token
from lmlab.generation.stream import StopStrings, dropped_warning, token_text
from lmlab.nn.masks import position_ids_from_attention_mask


@dataclass
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; repetition_penalty 1 = off."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        """LmlabError for a bad value: the sampling ones through
        :func:`~lmlab.generation.sampling.check_sampling`, then max_new_tokens and seed."""
        check_sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty)
        if self.max_new_tokens < 0:
            raise LmlabError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63 - 2**20:  # seed + row
            raise LmlabError(f"--seed must be a 64-bit integer (|seed| < 2**63), got {self.seed}")


def _generator(seed: int | None, row: int) -> torch.Generator:
    """Row ``row``'s sampling generator: seeded with ``seed + row``, or from OS entropy."""
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed + row)
    else:
        gen.seed()
    return gen


@torch.no_grad()
def _decode(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    max_seq_len: int,
    eos_id: int | None,
    pad_id: int,
    stop_row: Callable[[int, int], bool] | None = None,
    n_tokens: int | None = None,
) -> Iterator[list[int | None]]:
    """The decode loop shared by every entry point. Yields, per step, each row's new token (None
    for a row that has finished: at ``eos_id``, which is not yielded, or once ``stop_row(row,
    token)`` said so after yielding ``token``). Ids at or above ``n_tokens`` (the tokenizer's
    vocabulary, when the model's output is padded wider, as many Hugging Face models are) are
    never sampled.

    Each row keeps ``hist`` (prompt + new tokens), ``start`` (where its context begins in
    ``hist``) and ``fed`` (its real tokens in the cache). A step feeds every unfinished row its
    last token and every finished row a masked ``pad_id``. When a row's ``fed`` reaches
    ``max_seq_len``, the whole batch is rebuilt from a fresh cache, left-padded: that row from its
    last 3/4 of the window (its new ``start``), the others from ``hist[start:]`` (shorter than the
    window). So each row sees exactly the context it would see alone.
    """
    device = next(model.parameters()).device
    b = len(prompts)
    gens = [_generator(params.seed, i) for i in range(b)]
    hist = [list(p) for p in prompts]
    start, fed = [0] * b, [0] * b
    done = [False] * b
    keep = max(1, (max_seq_len * 3) // 4)
    cache = model.new_cache()  # type: ignore[operator]
    mask: torch.Tensor | None = None  # (B, S) 1 = real token, over every slot in the cache
    lean: lean_step.LeanStep | None = None  # the lean one-token step for this cache
    lean_tried: object = None  # the cache lean_refusal was last asked about

    def feed(chunks: list[list[int]]) -> torch.Tensor:
        """Append ``chunks`` (row i's tokens, left-padded to one width W) -> logits (B, 1, V)."""
        nonlocal mask, lean, lean_tried
        w = max(len(c) for c in chunks)
        x = torch.tensor([[pad_id] * (w - len(c)) + c for c in chunks], device=device)  # (B, W)
        new = torch.tensor([[0] * (w - len(c)) + [1] * len(c) for c in chunks], device=device)
        mask = new if mask is None else torch.cat([mask, new], dim=1)  # (B, S)
        for i, c in enumerate(chunks):
            fed[i] += len(c)
        if bool(mask.all()):  # no padding anywhere: the plain causal forward, positions 0..
            if w == 1 and lean_step.ENABLED and cache.seq_len > 0:
                if lean_tried is not cache:  # once per cache: whether the lean step applies
                    lean_tried = cache
                    lean = None
                    if lean_step.lean_refusal(model, cache) is None:
                        room = min(max_seq_len, cache.seq_len + params.max_new_tokens)
                        lean = lean_step.LeanStep(model, cache, room)
                if lean is not None and not lean.declines():
                    # the forward's logits: bit for bit from the Python loop, to float32
                    # rounding from the one-call C++ step (lmlab.nn.decode_kernel)
                    return lean(x)
            return model(x, cache=cache, last_only=True).logits
        positions = position_ids_from_attention_mask(mask)[:, -w:]  # (B, W)
        out = model(x, cache=cache, last_only=True, attention_mask=mask, position_ids=positions)
        return out.logits

    if params.max_new_tokens == 0:
        return
    # the history only matters to a repetition penalty (1 leaves logits as they are): without
    # one, no (S,) id tensor is built per token
    penalised = params.repetition_penalty != 1.0
    no_history = torch.empty(0, dtype=torch.long)
    logits = feed(hist)  # prefill every prompt at once
    for step in range(params.max_new_tokens):
        toks: list[int | None] = [None] * b
        for i in range(b):
            if done[i]:
                continue
            row_logits = logits[i, -1].cpu()
            if n_tokens is not None and n_tokens < row_logits.shape[-1]:
                row_logits = row_logits.clone()
                row_logits[n_tokens:] = float("-inf")  # ids the tokenizer has no text for
            tok = next_token(
                row_logits,
                torch.tensor(hist[i], dtype=torch.long) if penalised else no_history,
                params.temperature,
                params.top_k,
                params.top_p,
                params.repetition_penalty,
                gens[i],
            )
            if eos_id is not None and tok == eos_id:
                done[i] = True
                continue
            toks[i] = tok
            hist[i].append(tok)
            if stop_row is not None and stop_row(i, tok):
                done[i] = True
        yield toks
        if all(done) or step == params.max_new_tokens - 1:
            return
        full = [not done[i] and fed[i] >= max_seq_len for i in range(b)]
        if any(full) and not _streams(model, cache):  # rebuild from recent tokens
            cache, mask, fed = model.new_cache(), None, [0] * b  # type: ignore[operator]
            start = [max(0, len(hist[i]) - keep) if full[i] else start[i] for i in range(b)]
            chunks = [[] if done[i] else hist[i][start[i] :] for i in range(b)]
        else:
            chunks = [[] if done[i] else hist[i][-1:] for i in range(b)]
        logits = feed(chunks)


def _streams(model: nn.Module, cache: object) -> bool:
    """Whether decoding may run past ``max_seq_len`` with no rebuild: every layer's cache is
    bounded and says so (``streams``: the StreamingLLM cache, :mod:`lmlab.nn.sinks`) and the
    position encoding has no table that ends at max_seq_len (learned positions do)."""
    layers = getattr(cache, "layers", None) or []
    table = getattr(getattr(model, "position", None), "table_limit", False)
    return bool(layers) and all(getattr(c, "streams", False) for c in layers) and not table


def _check_ids(model: nn.Module, ids: list[int], what: str, max_seq_len: int) -> None:
    """LmlabError unless ``ids`` is a non-empty list of ids in the model's vocabulary, at most
    ``max_seq_len`` long."""
    if not ids:
        raise LmlabError(f"{what} is empty; give at least one token")
    if len(ids) > max_seq_len:
        raise LmlabError(
            f"{what} has {len(ids)} tokens, more than the context of {max_seq_len}; "
            "truncate it first"
        )
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise LmlabError(f"{what} holds token id {bad}, outside the vocabulary 0..{vocab - 1}")


def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    params: SamplingParams,
    max_seq_len: int,
    eos_id: int | None = None,
    n_tokens: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time (the end-of-sequence token is not yielded): the decode
    loop of :func:`generate_batch` on a batch of one, streamed. Ids at or above ``n_tokens``
    (None: no limit) are never sampled: pass the tokenizer's vocabulary size when the model's
    output layer is padded wider than it.

    prompt_ids must be non-empty and at most ``max_seq_len`` long (the caller truncates).
    Sampling draws from a generator seeded with ``params.seed``. Raises LmlabError for a bad
    sampling value when called, before any id is asked for (:meth:`SamplingParams.validate`).
    """
    params.validate()
    return _ids(model, prompt_ids, params, max_seq_len, eos_id, n_tokens)


def _ids(
    model: nn.Module,
    prompt_ids: list[int],
    params: SamplingParams,
    max_seq_len: int,
    eos_id: int | None,
    n_tokens: int | None,
) -> Iterator[int]:
    for toks in _decode(model, [prompt_ids], params, max_seq_len, eos_id, 0, n_tokens=n_tokens):
        if toks[0] is not None:
            yield toks[0]


def generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    max_seq_len: int,
    eos_id: int | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Continue several prompts at once; returns each prompt's new token ids (without EOS).

    The prompts are left-padded with ``pad_id`` into one (B, S) batch with an ``attention_mask``
    (1 = real token) from which each row's positions are derived
    (:func:`lmlab.nn.masks.position_ids_from_attention_mask`, as Hugging Face ``generate`` does),
    prefilled once, then decoded one token per step through the KV cache. A row stops at
    ``eos_id`` or ``params.max_new_tokens``; a finished row is fed ``pad_id``, masked, until every
    row has finished. So greedy batched generation equals generating each prompt alone
    (:func:`generate_ids`) token for token, up to float rounding; row i samples with the
    generator seeded ``params.seed + i``, so it equals :func:`generate_ids` with that seed.

    Past the context: when a row has ``max_seq_len`` tokens in the cache, the cache is rebuilt
    for the whole batch, that row keeping its last 3/4 of ``max_seq_len`` tokens and the others
    their current context, exactly as each row alone would (so rows may run past the window).
    One exception: RoPE ``dynamic_ntk`` scaling reads the largest position in the batch, so past
    its original length a shorter row is rotated as the longest one is.

    Raises LmlabError for an empty list, an empty prompt, a prompt longer than ``max_seq_len``
    tokens (truncate it first), or an id (``pad_id`` included) outside the model's vocabulary.
    """
    params.validate()
    if not prompts:
        raise LmlabError("generate_batch needs at least one prompt")
    for i, ids in enumerate(prompts):
        _check_ids(model, list(ids), f"prompt {i}", max_seq_len)
    _check_ids(model, [pad_id], "pad_id", max_seq_len)
    out: list[list[int]] = [[] for _ in prompts]
    for toks in _decode(model, [list(p) for p in prompts], params, max_seq_len, eos_id, pad_id):
        for row, tok in zip(out, toks, strict=True):
            if tok is not None:
                row.append(tok)
    return out


def generate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams,
    max_seq_len: int,
    warn: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """Stream the continuation of ``prompt`` as text pieces (whole characters only), stopping at
    the tokenizer's end-of-sequence token, a stop string (not emitted) or ``max_new_tokens``.

    A prompt longer than ``max_seq_len`` tokens keeps its last ``max_seq_len`` tokens and says so
    through ``warn``. Bytes that do not form a whole UTF-8 character (a character cut by
    ``max_new_tokens``) are dropped, never shown as U+FFFD, and ``warn`` says how many. Raises
    DataError for characters a char-level vocabulary lacks, LmlabError for an empty prompt.
    """
    params.validate()  # checked here, before the first piece is asked for
    warn = warn or _stderr
    ids = _prompt_ids(tokenizer, prompt, max_seq_len, warn, "the prompt")
    return _stream(model, tokenizer, ids, params, max_seq_len, warn)


def generate_texts(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: list[str],
    params: SamplingParams,
    max_seq_len: int,
    warn: Callable[[str], None] | None = None,
) -> list[str]:
    """The continuations of several prompts, generated as one left-padded batch
    (:func:`generate_batch`): each one the text :func:`generate_text` would stream for that
    prompt alone (with ``params.seed + i`` as the seed of prompt i), joined.

    A row stops at the end-of-sequence token, a stop string (cut, not included) or
    ``max_new_tokens``. Prompts longer than ``max_seq_len`` tokens keep their last
    ``max_seq_len`` tokens, with a warning naming the prompt (numbered from 1); so do bytes
    dropped because they do not form a whole UTF-8 character. Raises DataError
    for characters a char-level vocabulary lacks, LmlabError for no prompt or an empty prompt.
    """
    params.validate()
    if not prompts:
        raise LmlabError("give at least one --prompt")
    warn = warn or _stderr
    ids = [
        _prompt_ids(tokenizer, p, max_seq_len, warn, f"prompt {i + 1}")
        for i, p in enumerate(prompts)
    ]
    texts_of = [token_text(tokenizer, row) for row in ids]
    stops = [StopStrings(params.stop) for _ in prompts]
    texts = ["" for _ in prompts]
    stopped = [False] * len(prompts)

    def push(row: int, tok: int) -> bool:
        text, stopped[row] = stops[row].push(texts_of[row].push(tok))
        texts[row] += text
        return stopped[row]

    n = tokenizer.vocab_size
    for _ in _decode(model, ids, params, max_seq_len, tokenizer.eos_id, 0, push, n):
        pass
    for row in range(len(prompts)):
        if not stopped[row]:
            text, stopped[row] = stops[row].push(texts_of[row].flush())
            texts[row] += text if stopped[row] else text + stops[row].flush()
        if texts_of[row].dropped:
            warn(f"prompt {row + 1}: {dropped_warning(texts_of[row].dropped)}")
    return texts


def _prompt_ids(
    tokenizer: Tokenizer, prompt: str, max_seq_len: int, warn: Callable[[str], None], name: str
) -> list[int]:
    """Encode ``prompt``; an empty one becomes [eos] (LmlabError without one); one longer than
    ``max_seq_len`` keeps its last ``max_seq_len`` tokens, with a warning naming it."""
    ids = tokenizer.encode(prompt)
    if not ids:
        if tokenizer.eos_id is None:
            raise LmlabError(f"{name} is empty; give --prompt with at least one character")
        ids = [tokenizer.eos_id]
    if len(ids) > max_seq_len:
        warn(
            f"{name} has {len(ids)} tokens, more than the context of {max_seq_len}; "
            f"keeping its last {max_seq_len} tokens"
        )
        ids = ids[-max_seq_len:]
    return ids


def _stream(
    model: nn.Module,
    tokenizer: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    max_seq_len: int,
    warn: Callable[[str], None],
) -> Iterator[str]:
    pieces, stops = token_text(tokenizer, ids), StopStrings(params.stop)
    for tok in generate_ids(
        model, ids, params, max_seq_len, tokenizer.eos_id, tokenizer.vocab_size
    ):
        text, stopped = stops.push(pieces.push(tok))
        if text:
            yield text
        if stopped:
            return
    text, stopped = stops.push(pieces.flush())
    tail = text if stopped else text + stops.flush()
    if pieces.dropped:
        warn(dropped_warning(pieces.dropped))
    if tail:
        yield tail


def _stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)
