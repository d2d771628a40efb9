"""Batched, left-padded generation: each row generates what its prompt generates alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmlab.config import TokenizerConfig
from lmlab.data.tokenizer import train_tokenizer
from lmlab.errors import LmlabError
from lmlab.generation.generate import (
    SamplingParams,
    generate_batch,
    generate_ids,
    generate_text,
    generate_texts,
)
from lmlab.models import build_model
from tests.helpers import tiny_model_config

VOCAB = 50
# prompt lengths 3, 9 and 6: rows 0 and 2 are left-padded by 6 and 3 slots
PROMPTS = [[7, 3, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45]]

VARIANTS = {
    "rope": {},
    "learned": {"position": {"kind": "learned"}},
    "alibi": {"position": {"kind": "alibi"}},
    # a query sees 4 tokens: far fewer than prompt + new tokens (up to 21)
    "sliding_window": {"attention": {"n_heads": 4, "mask": "sliding_window", "window": 4}},
    "linear_attention": {"attention": {"n_heads": 4, "kind": "linear"}},
}


def _model(max_seq_len: int = 32, **model: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(tiny_model_config(VOCAB, max_seq_len=max_seq_len, **model)).eval()


def _alone(model, prompts, params, max_seq_len, eos_id=None):
    return [list(generate_ids(model, p, params, max_seq_len, eos_id)) for p in prompts]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_left_padded_batch_equals_each_prompt_alone(variant: str):
    model = _model(**VARIANTS[variant])
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    batch = generate_batch(model, PROMPTS, params, 32, pad_id=0)
    alone = _alone(model, PROMPTS, params, 32)
    assert batch == alone
    assert all(len(row) == 12 for row in batch)
    assert len({tuple(row) for row in batch}) == 3  # the rows really differ


def test_pad_id_does_not_change_the_result():
    model = _model(position={"kind": "learned"})
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    a = generate_batch(model, PROMPTS, params, 32, pad_id=0)
    b = generate_batch(model, PROMPTS, params, 32, pad_id=VOCAB - 1)
    assert a == b


@pytest.mark.parametrize("variant", ["rope", "learned", "sliding_window"])
def test_rows_run_past_the_context_window_as_they_would_alone(variant: str):
    # max_seq_len 8: each row's cache is rebuilt from its last 6 tokens, at different steps
    # (a learned-position model would raise past position 7 if a row ever went beyond it)
    cfg = dict(VARIANTS[variant])
    if variant == "sliding_window":
        cfg = {"attention": {"n_heads": 4, "mask": "sliding_window", "window": 3}}
    model = _model(max_seq_len=8, **cfg)
    prompts = [[5, 6], [1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    assert generate_batch(model, prompts, params, 8) == _alone(model, prompts, params, 8)


def test_a_row_stops_at_eos_while_the_others_go_on():
    model = _model()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = _alone(model, PROMPTS, params, 32)
    eos = free[0][4]  # row 0 emits this token 5th: make it the end-of-sequence token
    batch = generate_batch(model, PROMPTS, params, 32, eos_id=eos)
    assert batch[0] == free[0][: free[0].index(eos)]  # cut before EOS, EOS not included
    assert len(batch[0]) <= 4
    assert batch == _alone(model, PROMPTS, params, 32, eos_id=eos)
    assert max(len(row) for row in batch) == 12  # some row went on to max_new_tokens


def test_seeded_sampling_is_reproducible_and_row_i_uses_seed_plus_i():
    model = _model()
    params = SamplingParams(max_new_tokens=15, temperature=1.5, top_k=20, seed=3)
    a = generate_batch(model, PROMPTS, params, 32)
    assert a == generate_batch(model, PROMPTS, params, 32)
    other = generate_batch(model, PROMPTS, SamplingParams(15, 1.5, 20, seed=4), 32)
    assert a != other
    for i, prompt in enumerate(PROMPTS):
        alone = SamplingParams(max_new_tokens=15, temperature=1.5, top_k=20, seed=3 + i)
        assert a[i] == list(generate_ids(model, prompt, alone, 32))
    # the same prompt twice in one batch gives two different samples (seeds 3 and 4)
    twice = generate_batch(model, [PROMPTS[0], PROMPTS[0]], params, 32)
    assert twice[0] == a[0] and twice[0] != twice[1]


def test_max_new_tokens_zero_gives_empty_rows():
    model = _model()
    assert generate_batch(model, PROMPTS, SamplingParams(max_new_tokens=0), 32) == [[], [], []]


def test_bad_batches_raise_one_clear_error():
    model = _model()
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    cases = [
        ([], {}, "at least one prompt"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1] * 33], {}, "prompt 0 has 33 tokens, more than the context of 32"),
        ([[1, VOCAB]], {}, f"prompt 0 holds token id {VOCAB}, outside the vocabulary 0..49"),
        ([[1, 2]], {"pad_id": -1}, "pad_id holds token id -1"),
    ]
    for prompts, kwargs, msg in cases:
        with pytest.raises(LmlabError, match=msg):
            generate_batch(model, prompts, params, 32, **kwargs)
    with pytest.raises(LmlabError, match="--top-k"):
        generate_batch(model, [[1]], SamplingParams(top_k=-1), 32)


def test_generate_texts_equals_generate_text_per_prompt_with_stop_strings():
    tok = train_tokenizer("the cat sat on the mat.\n" * 40, TokenizerConfig(kind="char"))
    torch.manual_seed(1)
    cfg = tiny_model_config(tok.vocab_size, max_seq_len=32)
    model = build_model(cfg).eval()
    prompts = ["the", "a cat sat", "m"]
    for params in (
        SamplingParams(max_new_tokens=25, temperature=0.0),
        SamplingParams(max_new_tokens=25, temperature=1.0, seed=5, stop=["a", "t "]),
    ):
        texts = generate_texts(model, tok, prompts, params, 32)
        for i, prompt in enumerate(prompts):
            seed = None if params.seed is None else params.seed + i
            alone = dataclasses.replace(params, seed=seed)
            assert texts[i] == "".join(generate_text(model, tok, prompt, alone, 32)), i
    stopped = generate_texts(model, tok, prompts, SamplingParams(25, 1.0, seed=5, stop=["a"]), 32)
    assert all("a" not in t for t in stopped)
    warnings: list[str] = []
    generate_texts(model, tok, ["at", "t" * 40], SamplingParams(1), 32, warn=warnings.append)
    assert warnings == [
        "prompt 2 has 40 tokens, more than the context of 32; keeping its last 32 tokens"
    ]
