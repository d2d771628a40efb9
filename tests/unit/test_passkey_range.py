"""``data.passkey_min_distance`` / ``data.passkey_max_distance``: the training (and val) key
distances of the passkey corpus. Unset, the corpus is the one generated before the fields existed
(SHA-256 of both splits as recorded at commit 9ed2712); set, every document of both splits has its
key at a distance in the range, both ends drawn; the corpus fingerprint (the token cache's key)
changes with the range; bad values are one ConfigError naming the field. The compare report says
that a ``loss_on: answers`` val loss is over the answer tokens only."""

from __future__ import annotations

import copy
import hashlib
import random
from pathlib import Path

import pytest

from lmlab.config import config_from_dict
from lmlab.data import passkey
from lmlab.data.corpus import load_data
from lmlab.errors import ConfigError
from lmlab.experiments import report
from lmlab.experiments.report import loss_scope
from lmlab.experiments.spec import experiment_from_dict
from tests.helpers import TINY, assert_one_error, run_cli, tiny_config

# sha256 of passkey_splits() before data.passkey_*_distance existed (main at 9ed2712)
DEFAULT_SHA256 = {
    "train": "34f51c419afeb8bf373268c9e2c617c16b9987e4f203d67f13bea11cbb3cea35",
    "val": "f39f53a823d95815026f92c89e41ef1a631c9953c462ad196bb8e15a78b09992",
}
RANGE = (30, 48)


def _sha(splits: dict[str, str]) -> dict[str, str]:
    return {k: hashlib.sha256(v.encode("utf-8")).hexdigest() for k, v in splits.items()}


def _distances(text: str) -> list[int]:
    """Key-to-answer distance of every document: answer index - key digit index."""
    out = []
    for doc in text.split("\n")[:-1]:
        key = doc.index(passkey.KEY_PREFIX) + len(passkey.KEY_PREFIX)
        answer = doc.index(passkey.QUESTION) + len(passkey.QUESTION)
        out.append(answer - key)
    return out


@pytest.fixture(scope="module")
def ranged() -> dict[str, str]:
    return passkey.passkey_splits(*RANGE)


def _cfg(**data: object):
    """TINY on the passkey corpus with a 64-token context (keys up to 53 characters away)."""
    data = {"corpus": "passkey", "loss_on": "answers", **data}
    return tiny_config(data=data, model={"max_seq_len": 64})


def test_unset_range_is_the_old_corpus_bit_for_bit():
    cfg = _cfg()
    assert (cfg.data.passkey_min_distance, cfg.data.passkey_max_distance) == (None, None)
    assert _sha(load_data(cfg.data).splits) == DEFAULT_SHA256
    assert passkey.distance_range(None, None) == (passkey.MIN_DISTANCE, 224)


def test_set_range_bounds_every_document_of_both_splits(ranged):
    for split in ("train", "val"):
        d = _distances(ranged[split])
        assert len(d) > (300 if split == "val" else 10_000)
        assert min(d) == RANGE[0] and max(d) == RANGE[1]  # both ends drawn, nothing outside
        assert len(set(d)) == RANGE[1] - RANGE[0] + 1
    default = _distances(passkey.passkey_text(passkey.VAL_SEED, passkey.VAL_CHARS))
    assert min(default) == 20 and max(default) == 224  # the default really spans 20-224
    assert len(ranged["train"]) >= passkey.TRAIN_CHARS and len(ranged["val"]) >= 100_000


def test_the_range_reaches_the_run_and_changes_the_corpus_fingerprint(ranged):
    lo, hi = RANGE
    cfg = _cfg(passkey_min_distance=lo, passkey_max_distance=hi)
    corpus = load_data(cfg.data)
    assert corpus.splits == ranged
    # the token cache (lmlab.data.dataset) is keyed by this fingerprint: no sharing
    other = _cfg(passkey_max_distance=hi).data
    fps = {
        corpus.fingerprint(),
        load_data(other).fingerprint(),
        load_data(_cfg().data).fingerprint(),
    }
    assert len(fps) == 3
    assert config_from_dict(cfg.to_dict()).data.passkey_min_distance == lo  # YAML round trip


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"corpus": "recall", "passkey_max_distance": 40},
            "data.passkey_max_distance applies to data.corpus: passkey only, got data.corpus "
            "'recall'",
        ),
        ({"corpus": "tinyshakespeare", "passkey_min_distance": 20}, "data.passkey_min_distance"),
        ({"passkey_min_distance": 19}, "data.passkey_min_distance must be >= 20"),
        (
            {"passkey_min_distance": 25, "passkey_max_distance": 24},
            r"data.passkey_max_distance \(24\) must be >= data.passkey_min_distance \(25\)",
        ),
        # TINY's 32-token window: 32 - len("the key is ") = 21
        ({"passkey_max_distance": 22}, r"data.passkey_max_distance \(22\) is past .* \(21\)"),
        # only the min set: the max the message blames is the default, and it says so (it read
        # "data.passkey_max_distance (224) is past", a number the user never wrote)
        (
            {"passkey_min_distance": 21},
            r"data.passkey_max_distance \(unset: the default 224\) is past .* \(21\); set "
            r"data.passkey_max_distance <= 21",
        ),
        (
            {"passkey_min_distance": 300},
            r"data.passkey_max_distance \(unset: the default 224\) must be >= "
            r"data.passkey_min_distance \(300\)",
        ),
        ({"passkey_max_distance": "40"}, "data.passkey_max_distance: expected int or null"),
        ({"passkey_min_distance": 2.5}, "data.passkey_min_distance: expected int or null"),
    ],
)
def test_bad_ranges_are_refused_by_name(data, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(data={"corpus": "passkey", **data})


def test_the_window_bound_is_the_farthest_eval_prompt_and_the_edge_is_accepted():
    assert passkey.farthest_key(32) == 21
    cfg = _cfg(passkey_min_distance=20, passkey_max_distance=21)  # the edge is accepted
    assert (cfg.data.passkey_min_distance, cfg.data.passkey_max_distance) == (20, 21)
    s = passkey.passkey_sample(random.Random(0), 32 - passkey.KEY_LEN + 1, 21)
    # what the model reads: key sentence, gap, question and all but the last answer digit (the
    # last is predicted at the last position), as a training window's inputs and final target
    assert s.prompt.startswith(passkey.KEY_PREFIX) and len(s.prompt) + passkey.KEY_LEN - 1 == 32
    with pytest.raises(ConfigError, match="does not fit"):
        passkey.passkey_sample(random.Random(0), 32 - passkey.KEY_LEN + 1, 22)


def test_a_bad_range_from_the_cli_is_one_error_line(tmp_path, capsys):
    code, _, err = run_cli(
        capsys,
        "train",
        "--set",
        "data.corpus=passkey",
        "--set",
        "data.passkey_min_distance=10",
        "--out",
        tmp_path / "run",
    )
    assert_one_error(code, err, "data.passkey_min_distance must be >= 20")
    assert not (tmp_path / "run").exists()


def _experiment(variants: dict, data: dict):
    base = copy.deepcopy(TINY)
    base.pop("name")
    base["data"] = data
    raw = {"name": "pk", "claim": "c", "base": base, "variants": variants, "seeds": [1, 2]}
    return experiment_from_dict({**raw, "budget": {"steps": 2}}, Path("pk.yaml"))


def test_the_report_says_an_answer_loss_is_over_the_answer_tokens_only(tmp_path, monkeypatch):
    labels = []  # the val-curve plots (matplotlib: seconds) record their y label instead

    def plot_curves(groups, out, axis, title, ylabel="?"):
        labels.append(ylabel)
        return out, []

    monkeypatch.setattr(report, "plot_curves", plot_curves)
    data = {"corpus": "passkey", "loss_on": "answers", "passkey_max_distance": 21}
    exp = _experiment(
        {"full": {}, "sw": {"model.attention.mask": "sliding_window", "model.attention.window": 4}},
        data,
    )
    summaries = [
        {"variant": v, "seed": s, "val_loss": 2.0 + s / 10, "step": 2, "val_curve": []}
        for v in exp.variants
        for s in exp.seeds
    ]
    report.write_report(exp, tmp_path, summaries)
    assert labels == ["val answer loss (nats/answer token)"] * 2
    text = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| variant | val answer loss (nats/answer token) | perplexity |" in text
    assert "| training time (s) | val answer loss (nats/answer token) |" in text  # per-run rows
    assert "mean cross-entropy over the answer tokens only" in text
    assert "key distances uniform in 20-21 characters" in text
    assert "val loss (nats/token)" not in text and "every token" not in text


def test_the_report_keeps_the_all_token_wording_and_names_mixed_variants():
    plain = _experiment({"a": {}}, {"corpus": "passkey"})
    assert loss_scope(plain) == (
        "val loss (nats/token)",
        "mean cross-entropy over every token of train.eval_batches fixed random windows of "
        "the val split",
    )
    mixed = _experiment({"a": {}, "b": {"data.loss_on": "answers"}}, {"corpus": "passkey"})
    head, what = loss_scope(mixed)
    assert head == "val loss (nats/token)"
    assert "except for `b`: mean cross-entropy over the answer tokens only" in what
    assert "key distances" not in what  # the default range is not announced
