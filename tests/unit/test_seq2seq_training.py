"""Seq2seq training: pair files, the reverse task, the seq2seq and span-corruption objectives'
batches, training that lowers the loss and resumes bit-identically, and exact-match scoring."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmlab.config import ModelConfig
from lmlab.data.dataset import batch_rng
from lmlab.data.pairs import load_pairs, read_pairs, reverse_pairs
from lmlab.evaluation.seq2seq import score_pairs
from lmlab.training.objectives import (
    OBJECTIVES,
    Seq2Seq,
    SpanCorruption,
    collate_pairs,
    prepare_tokenizer,
    random_segmentation,
    span_corrupt,
)
from tests.helpers import seq2seq_run_config, write_reverse_tsv

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_has_seq2seq_and_span_corruption():
    assert {"seq2seq", "span_corruption"} <= set(OBJECTIVES.names())


def test_tsv_and_jsonl_give_the_same_pairs_and_the_last_tenth_is_val(tmp_path):
    pairs = [(f"s{i}", f"t{i}") for i in range(20)]
    tsv, jsonl = tmp_path / "p.tsv", tmp_path / "p.jsonl"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in pairs) + "\n", encoding="utf-8")
    jsonl.write_text(
        "".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in pairs), encoding="utf-8"
    )
    assert read_pairs(tsv) == read_pairs(jsonl) == pairs
    split = load_pairs(tsv, 0.1)
    assert split["train"] == pairs[:18] and split["val"] == pairs[18:]


def test_reverse_task_targets_are_reversals_and_val_is_disjoint_and_fixed():
    a = reverse_pairs(n_train=2000, n_val=200)
    assert a == reverse_pairs(n_train=2000, n_val=200)  # a fixed seed: the same pairs everywhere
    for s, t in a["train"] + a["val"]:
        assert t == s[::-1] and 4 <= len(s) <= 16 and set(s) <= set("abcdefgh")
    assert not {s for s, _ in a["val"]} & {s for s, _ in a["train"]}
    lengths = {len(s) for s, _ in a["train"]}
    assert lengths == set(range(4, 17))  # every length occurs


def test_collate_pads_sources_marks_target_padding_and_shifts_behind_the_start_token():
    pad, start, eos = 0, 1, 2
    batch = collate_pairs([([5, 6, 7], [7, 6, 5, eos]), ([8], [8, eos])], pad, start)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["targets"].tolist() == [[7, 6, 5, eos], [8, eos, -100, -100]]
    assert batch["decoder_input_ids"].tolist() == [[start, 7, 6, 5], [start, 8, eos, pad]]
    assert all(v.dtype == torch.int64 for v in batch.values())


def _objective(tmp_path, cls=Seq2Seq, objective="seq2seq"):
    from lmlab.data.corpus import load_corpus
    from lmlab.data.tokenizer import fit_tokenizer
    from lmlab.training.objectives import set_seq2seq_ids

    cfg = seq2seq_run_config(write_reverse_tsv(tmp_path), objective=objective)
    corpus = load_corpus(cfg.data.corpus, cfg.data.val_fraction)
    tok = prepare_tokenizer(cfg, fit_tokenizer(corpus.splits, cfg.data.tokenizer))
    cfg.model.vocab_size = tok.vocab_size
    set_seq2seq_ids(cfg, tok)
    splits = {k: np.asarray(tok.encode(v), dtype=np.int64) for k, v in corpus.splits.items()}
    return cls(cfg, tok, splits, cfg.model.max_seq_len), tok


def test_seq2seq_batches_are_the_pairs_and_a_pure_function_of_the_generator(tmp_path):
    obj, tok = _objective(tmp_path)
    b1 = obj.batch("train", 8, batch_rng(1, 5, 0))
    b2 = obj.batch("train", 8, batch_rng(1, 5, 0))
    assert all(torch.equal(b1[k], b2[k]) for k in b1)
    assert not torch.equal(b1["input_ids"], obj.batch("train", 8, batch_rng(1, 6, 0))["input_ids"])
    eos = tok.eos_id
    for src, mask, tgt in zip(b1["input_ids"], b1["attention_mask"], b1["targets"], strict=True):
        s = tok.decode(src[mask.bool()].tolist())
        real = tgt[tgt != -100].tolist()
        assert real[-1] == eos and tok.decode(real[:-1]) == s[::-1]  # target = reversed + </s>
    assert b1["input_ids"].shape[1] == int(b1["attention_mask"].sum(1).max())  # per-batch padding


def test_random_segmentation_is_a_composition():
    rng = np.random.default_rng(0)
    for n, k in [(10, 3), (5, 5), (7, 1)]:
        lengths = random_segmentation(n, k, rng)
        assert len(lengths) == k and lengths.sum() == n and lengths.min() >= 1


class _FixedCuts:
    """A generator stand-in whose choice() returns given cut points (to spell out a corruption)."""

    def __init__(self, *cuts: list[int]) -> None:
        self.cuts = list(cuts)

    def choice(self, a, size, replace):
        return np.array(self.cuts.pop(0))


def test_span_corruption_of_a_hand_example():
    # 20 tokens, 15%: 3 noise tokens in round(3 / 3) = 1 span... use 40 tokens: 6 noise, 2 spans
    tokens = np.arange(100, 140)
    sentinels = [900, 901, 902]
    # noise lengths: 6 split at 2 -> (2, 4); kept lengths: 34 split at 10 -> (10, 24)
    src, tgt = span_corrupt(tokens, sentinels, _FixedCuts([2], [10]))  # type: ignore[arg-type]
    assert src == [*range(100, 110), 900, *range(112, 136), 901]
    assert tgt == [900, 110, 111, 901, 136, 137, 138, 139, 902]


def test_span_corruption_keeps_every_token_exactly_once(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, size=64)
    sentinels = list(range(1000, 1100))
    src, tgt = span_corrupt(tokens, sentinels, rng)
    n_spans = sum(t >= 1000 for t in src)
    assert n_spans == round(round(64 * 0.15) / 3)  # 10 noise tokens in 3 spans
    assert len(tgt) - n_spans - 1 == round(64 * 0.15)
    # put the spans back where their sentinels stand: the original text
    spans: dict[int, list[int]] = {}
    for t in tgt:
        if t >= 1000:
            cur = spans.setdefault(t, [])
        else:
            cur.append(t)
    rebuilt = [x for t in src for x in (spans[t] if t >= 1000 else [t])]
    assert rebuilt == tokens.tolist()


def test_span_corruption_adds_sentinels_to_the_tokenizer_and_batches(tmp_path):
    obj, tok = _objective(tmp_path, SpanCorruption, "span_corruption")
    assert len(obj.sentinels) == 100 and tok.encode("<extra_id_0>") == [obj.sentinels[0]]
    assert obj.sentinels[0] >= 260  # appended after the fitted vocabulary
    b = obj.batch("train", 4, batch_rng(0, 0, 0))
    first = b["targets"][:, 0].tolist()
    assert first == [obj.sentinels[0]] * 4  # every target starts with the first sentinel
    assert torch.equal(b["decoder_input_ids"][:, 1:2], b["targets"][:, :1])


def test_seq2seq_training_lowers_the_loss_and_resumes_bit_identically(tmp_path):
    from lmlab.training.checkpoint import latest_checkpoint
    from lmlab.training.trainer import train

    tsv = write_reverse_tsv(tmp_path)
    cfg = seq2seq_run_config(tsv, max_steps=24, eval_every=12, lr_decay_steps=24)
    full = train(cfg, out=tmp_path / "full", progress=False)
    first_val = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    assert full.val_loss < first_val["val_loss"] - 1.0
    half = seq2seq_run_config(tsv, max_steps=12, eval_every=12, lr_decay_steps=24)
    train(half, out=tmp_path / "half", progress=False)
    again = seq2seq_run_config(tsv, max_steps=12, eval_every=12, lr_decay_steps=24)
    # resuming with the config file too: the special ids filled from the tokenizer still match
    resumed = train(again, resume=tmp_path / "half", max_steps=24, progress=False)
    assert resumed.train_loss == full.train_loss and resumed.val_loss == full.val_loss
    from safetensors.torch import load_file

    a = load_file(latest_checkpoint(tmp_path / "full") / "model.safetensors")
    b = load_file(latest_checkpoint(tmp_path / "half") / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Reverser(torch.nn.Module):
    """A hand-made encoder-decoder that outputs the reversed source, then EOS; with ``wrong``
    it writes token 3 instead of the first output token of sources starting with token 4."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.cfg = ModelConfig(kind="encoder_decoder", vocab_size=8, max_seq_len=16)
        self.cfg.seq2seq.pad_token_id, self.cfg.seq2seq.decoder_start_token_id = 0, 1
        self.cfg.seq2seq.eos_token_id = 2
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.wrong = wrong

    def encode(self, ids, mask):
        return torch.stack([ids.float(), mask.float()], -1)  # (B, S, 2)

    def new_cache(self):
        return {"n": 0}

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, cache=None,
                encoder_hidden_states=None, last_only=False, **_):  # fmt: skip
        mem = encoder_hidden_states
        if mem is None:
            mem = self.encode(input_ids, attention_mask)
        b, t = decoder_input_ids.shape
        past = cache["n"] if cache is not None else 0
        if cache is not None:
            cache["n"] += t
        logits = torch.zeros(b, t, 8)
        for i in range(b):
            src = mem[i, :, 0][mem[i, :, 1] > 0].long().tolist()
            for j in range(t):
                p = past + j
                tok = src[len(src) - 1 - p] if p < len(src) else 2
                if self.wrong and p == 0 and src[0] == 4:
                    tok = 3
                logits[i, j, tok] = 10.0
        return SimpleNamespace(logits=logits[:, -1:] if last_only else logits)


def test_exact_match_and_token_accuracy_of_perfect_and_imperfect_models():
    sources = [[4, 5, 6], [5, 6], [4, 7], [6, 5, 7, 4]]
    pairs = [(s, [*s[::-1], 2]) for s in sources]
    perfect = score_pairs(_Reverser(), pairs, batch_size=3)
    assert perfect.exact_match == 1.0 and perfect.token_accuracy == 1.0
    assert perfect.tokens == 3 + 2 + 2 + 4 + 4  # targets + one EOS each
    flawed = score_pairs(_Reverser(wrong=True), pairs, batch_size=3)
    assert flawed.exact_match == 0.5  # the two sources starting with token 4 come out wrong
    assert flawed.token_accuracy == pytest.approx(13 / 15)
    assert flawed.loss > perfect.loss


def test_a_span_corruption_run_trains_saves_its_sentinels_and_resumes(tmp_path):
    from lmlab.run import load_run
    from lmlab.training.trainer import train

    cfg = seq2seq_run_config("tinyshakespeare", "span_corruption", max_steps=12, eval_every=6)
    res = train(cfg, out=tmp_path / "sc", progress=False)
    first = json.loads((tmp_path / "sc" / "metrics.jsonl").read_text().splitlines()[0])
    # 12 steps with the cosine ending at min_lr on the last one: 5.89 -> 4.92 nats (seed 0)
    assert res.val_loss < first["val_loss"] - 0.8
    run = load_run(tmp_path / "sc", "cpu")
    assert run.tokenizer.vocab_size == 360 == run.config.model.vocab_size  # 260 + 100 sentinels
    assert run.tokenizer.encode("<extra_id_99>") == [359]
    again = train(resume=tmp_path / "sc", max_steps=14, progress=False)  # the tokenizer reloads
    assert again.step == 14
