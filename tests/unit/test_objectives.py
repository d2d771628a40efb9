"""Training objectives: clm draws exactly the batches the trainer drew before objectives
existed; mlm masks as BERT does (15% selected, 80/10/10, specials never, whole words)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmlab.config import TokenizerConfig
from lmlab.data.dataset import batch_rng, sample_batch
from lmlab.data.tokenizer import train_tokenizer
from lmlab.errors import LmlabError
from lmlab.training.objectives import OBJECTIVES, CausalLM, MaskedLM, build_objective
from tests.helpers import encoder_run_config, tiny_config

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
    "You are all resolved rather to die than to famish?\nResolved. resolved.\n"
) * 20


def _wordlevel():
    return train_tokenizer(TEXT, TokenizerConfig(kind="wordlevel", vocab_size=40))


def _mlm(tokenizer=None, **train) -> MaskedLM:
    tok = tokenizer or _wordlevel()
    ids = np.asarray(tok.encode(TEXT), dtype=np.int64)
    cfg = encoder_run_config(**train)
    return MaskedLM(cfg, tok, {"train": ids, "val": ids}, 32)


def test_registry_lists_clm_and_mlm():
    assert {"clm", "mlm"} <= set(OBJECTIVES.names())


def test_clm_batch_is_the_trainers_former_sample_batch_bit_for_bit():
    tokens = np.arange(1000, dtype=np.uint16) % 61
    obj = CausalLM(tiny_config(), None, {"train": tokens}, 16)  # type: ignore[arg-type]
    batch = obj.batch("train", 4, batch_rng(1337, 5, 2))
    x, y = sample_batch(tokens, 4, 16, batch_rng(1337, 5, 2))
    assert set(batch) == {"input_ids", "targets"}
    assert torch.equal(batch["input_ids"], x) and torch.equal(batch["targets"], y)
    assert obj.tokens_per_batch(4) == 64


def test_mlm_selects_round_15_percent_of_maskable_tokens_never_a_special_or_whitespace():
    obj = _mlm()
    tok = obj.tokenizer
    newline = tok.encode("\n")[0]
    b = obj.batch("train", 64, batch_rng(1, 0, 0))
    rows = obj.windows("train", 64, batch_rng(1, 0, 0))  # the same windows, unmasked
    x, y = b["input_ids"].numpy(), b["targets"].numpy()
    assert (x[:, 0] == tok.cls_id).all() and (x[:, -1] == tok.sep_id).all()
    selected = y != -100
    assert not selected[:, 0].any() and not selected[:, -1].any()
    blanks = 0
    for row, row_target, row_sel in zip(rows, y, selected, strict=True):
        n_blank = int(sum(tok.token_bytes(int(i)).isspace() for i in row[1:-1]))
        blanks += n_blank
        assert row_sel.sum() == round(0.15 * (30 - n_blank))  # 30 tokens in [CLS] ... [SEP]
        assert not np.isin(row_target[row_sel], list(tok.special_ids())).any()
        assert not (row_target[row_sel] == newline).any()
    assert blanks > 64  # newlines did occur, and were never selected


def test_mlm_replaces_80_percent_by_mask_10_by_random_10_kept():
    obj = _mlm()
    b = obj.batch("train", 2000, batch_rng(3, 1, 0))
    x, y = b["input_ids"].numpy(), b["targets"].numpy()
    sel = y != -100
    n = sel.sum()
    masked = (x[sel] == obj.mask_id).mean()
    kept = (x[sel] == y[sel]).mean()
    assert abs(masked - 0.8) < 0.01 and 0.1 < kept < 0.12  # a random pick may equal the original
    assert abs(1 - masked - kept - 0.1 * (1 - 1 / len(obj.ordinary))) < 0.015
    assert not np.isin(x[sel], sorted(obj.tokenizer.special_ids() - {obj.mask_id})).any()
    original = obj.windows("train", 2000, batch_rng(3, 1, 0))  # the same windows, unmasked
    assert (x[~sel] == original[~sel]).all() and (y[sel] == original[sel]).all() and n > 0


def test_mlm_batches_are_a_pure_function_of_seed_step_micro_rank():
    obj = _mlm()
    a = obj.batch("train", 8, batch_rng(7, 3, 1, 0))
    b = obj.batch("train", 8, batch_rng(7, 3, 1, 0))
    c = obj.batch("train", 8, batch_rng(7, 4, 1, 0))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_whole_word_masking_selects_every_token_of_a_word_or_none():
    tok = train_tokenizer(TEXT, TokenizerConfig(kind="bpe", vocab_size=270, special_tokens="bert"))
    obj = _mlm(tok, whole_word_mask=True)
    b = obj.batch("train", 32, batch_rng(5, 0, 0))
    rows, sel = obj.windows("train", 32, batch_rng(5, 0, 0)), b["targets"].numpy() != -100
    multi = 0
    for row, s in zip(rows, sel, strict=True):
        words = obj.word_ids(row)
        for w in np.unique(words[s]):
            members = (words == w) & ~obj.is_special[row]
            assert s[members].all()  # the whole word is selected
            multi += int(members.sum() > 1)
    assert multi > 0  # words of several BPE tokens did occur
    # with whole-word masking off the same batch splits some word
    plain = _mlm(tok).batch("train", 32, batch_rng(5, 0, 0))["targets"].numpy() != -100
    split = any(
        not s[obj.word_ids(r) == w].all()
        for r, s in zip(rows, plain, strict=True)
        for w in np.unique(obj.word_ids(r)[s])
    )
    assert split


def test_mlm_needs_a_tokenizer_with_a_mask_token():
    tok = train_tokenizer(TEXT, TokenizerConfig(kind="bpe", vocab_size=270))
    with pytest.raises(LmlabError, match="mask token"):
        build_objective(encoder_run_config(), tok, {"train": np.zeros(100)}, 32)
