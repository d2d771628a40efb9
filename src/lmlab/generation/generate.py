"""The decode loop: prefill the prompt once, then one cached step per new token.

When the context fills up, the cache is rebuilt from the last 3/4 of ``max_seq_len`` tokens, so
generation can run past the window without ever attending beyond it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import LmlabError
from lmlab.generation.sampling import next_token
from lmlab.generation.stream import StopStrings, Utf8Stream


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
        for name, value in (
            ("--temperature", self.temperature),
            ("--top-p", self.top_p),
            ("--repetition-penalty", self.repetition_penalty),
        ):
            if not math.isfinite(value):
                raise LmlabError(f"{name} must be a finite number, got {value}")
        if self.max_new_tokens < 0:
            raise LmlabError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise LmlabError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LmlabError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LmlabError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise LmlabError(f"--repetition-penalty must be > 0, got {self.repetition_penalty}")


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    params: SamplingParams,
    max_seq_len: int,
    eos_id: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time (the end-of-sequence token is not yielded).

    prompt_ids must be non-empty and at most ``max_seq_len`` long (the caller truncates).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    ids = list(prompt_ids)
    cache = model.new_cache()  # type: ignore[operator]
    logits = model(torch.tensor([ids], device=device), cache=cache, last_only=True).logits
    keep = max(1, (max_seq_len * 3) // 4)
    for _ in range(params.max_new_tokens):
        history = torch.tensor(ids, dtype=torch.long)
        tok = next_token(
            logits[0, -1].cpu(),
            history,
            params.temperature,
            params.top_k,
            params.top_p,
            params.repetition_penalty,
            gen,
        )
        if eos_id is not None and tok == eos_id:
            return
        yield tok
        ids.append(tok)
        if cache.seq_len >= max_seq_len:  # window full: rebuild from the most recent tokens
            cache = model.new_cache()  # type: ignore[operator]
            x = torch.tensor([ids[-keep:]], device=device)
        else:
            x = torch.tensor([[tok]], device=device)
        logits = model(x, cache=cache, last_only=True).logits


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
    through ``warn``. Raises DataError for characters a char-level vocabulary lacks, LmlabError
    for an empty prompt.
    """
    params.validate()  # checked here, before the first piece is asked for
    ids = tokenizer.encode(prompt)
    if not ids:
        if tokenizer.eos_id is None:
            raise LmlabError("the prompt is empty; give --prompt with at least one character")
        ids = [tokenizer.eos_id]
    if len(ids) > max_seq_len:
        (warn or _stderr)(
            f"the prompt has {len(ids)} tokens, more than the context of {max_seq_len}; "
            f"keeping its last {max_seq_len} tokens"
        )
        ids = ids[-max_seq_len:]
    return _stream(model, tokenizer, ids, params, max_seq_len)


def _stream(
    model: nn.Module, tokenizer: Tokenizer, ids: list[int], params: SamplingParams, max_seq_len: int
) -> Iterator[str]:
    utf8, stops = Utf8Stream(), StopStrings(params.stop)
    for tok in generate_ids(model, ids, params, max_seq_len, tokenizer.eos_id):
        text, stopped = stops.push(utf8.push(tokenizer.token_bytes(tok)))
        if text:
            yield text
        if stopped:
            return
    text, stopped = stops.push(utf8.flush())
    tail = text if stopped else text + stops.flush()
    if tail:
        yield tail


def _stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)
