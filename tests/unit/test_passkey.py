"""The passkey corpus (lmlab.data.passkey), its accuracy-vs-distance metric
(lmlab.evaluation.passkey) and the ``eval.passkey`` field of an experiment file."""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
from torch import nn

from lmlab.data.corpus import load_corpus
from lmlab.data.passkey import (
    FILLER_TEXT,
    KEY_LEN,
    KEY_PREFIX,
    MIN_DISTANCE,
    QUESTION,
    TRAIN_MAX_DISTANCE,
    filler,
    passkey_sample,
    passkey_text,
)
from lmlab.data.recall import (
    ASK,
    DOC_SLOTS,
    FILLER,
    KEYS,
    MAX_GAP,
    SLOT,
    farthest,
    recall_sample,
    recall_text,
)
from lmlab.data.tokenizer import CharTokenizer
from lmlab.errors import ConfigError
from lmlab.evaluation.passkey import (
    PasskeyEval,
    accuracy_cells,
    greedy_answerer,
    passkey_accuracy,
    prompt_length,
    window_reach,
)
from lmlab.experiments.spec import experiment_from_dict
from tests.helpers import TINY, assert_one_error, run_cli

# ------------------------------------------------------------------------------- generator


def test_generator_is_deterministic_from_its_seed():
    assert passkey_text(5, 4000) == passkey_text(5, 4000)
    assert passkey_text(5, 4000) != passkey_text(6, 4000)
    a, b = random.Random(3), random.Random(3)
    assert passkey_sample(a, 200, 100) == passkey_sample(b, 200, 100)


@pytest.mark.parametrize("length,distance", [(254, 22), (254, 24), (254, 131), (254, 243)])
def test_sample_answer_lies_at_the_stated_distance(length, distance):
    rng = random.Random(0)
    for _ in range(20):
        s = passkey_sample(rng, length, distance)
        assert len(s.prompt) == length and s.prompt.endswith(QUESTION)
        assert s.prompt.count(KEY_PREFIX) == 1 and s.prompt.count("key") == 2
        key_at = s.prompt.index(KEY_PREFIX) + len(KEY_PREFIX)
        assert key_at == length - distance  # the answer's first digit would sit at `length`
        assert s.prompt[key_at : key_at + KEY_LEN] == s.answer and s.answer.isdigit()
        assert sum(c.isdigit() for c in s.prompt) == KEY_LEN  # the only digits are the key


def test_training_documents_answer_their_own_key_within_the_distance_range():
    docs = passkey_text(0, 20_000).split("\n")[:-1]
    distances = []
    for doc in docs:
        key_at = doc.index(KEY_PREFIX) + len(KEY_PREFIX)
        answer_at = doc.index(QUESTION) + len(QUESTION)
        assert doc[key_at : key_at + KEY_LEN] == doc[answer_at : answer_at + KEY_LEN]
        assert doc.endswith(doc[key_at : key_at + KEY_LEN] + ".")
        distances.append(answer_at - key_at)
    assert min(distances) >= MIN_DISTANCE and max(distances) <= TRAIN_MAX_DISTANCE
    assert max(distances) - min(distances) > 150  # spread over the range, not one value


def test_filler_is_exact_length_and_holds_no_digit_key_or_question_word():
    rng = random.Random(1)
    assert all(len(filler(rng, n)) == n for n in range(200))
    assert not {"the", "key", "is", "what"} & set(FILLER_TEXT.replace(".", "").split())
    assert not any(c.isdigit() for c in FILLER_TEXT) and "the" not in FILLER_TEXT


def test_a_distance_that_cannot_hold_the_key_is_refused():
    with pytest.raises(ConfigError, match=f">= {MIN_DISTANCE}"):
        passkey_sample(random.Random(0), 254, MIN_DISTANCE - 1)
    with pytest.raises(ConfigError, match="does not fit"):
        passkey_sample(random.Random(0), 100, 100)


def test_passkey_is_a_corpus_name():
    corpus = load_corpus("passkey")
    assert set(corpus.splits) == {"train", "val"} and corpus.split("val").count(QUESTION) > 500


# ------------------------------------------------------------------------------- the metric

SPEC = PasskeyEval(distances=[24, 40, 100], samples=12, seed=3, batch_size=5)
LENGTH = prompt_length(128)


def perfect(prompts):
    return [re.search(r"the key is (\d+)\.", p).group(1) for p in prompts]


def test_accuracy_of_a_perfect_and_an_always_wrong_model():
    assert passkey_accuracy(perfect, SPEC, LENGTH) == {24: 1.0, 40: 1.0, 100: 1.0}
    assert passkey_accuracy(lambda ps: ["x" * KEY_LEN] * len(ps), SPEC, LENGTH) == {
        24: 0.0,
        40: 0.0,
        100: 0.0,
    }
    # a model right on every other prompt: exactly one half (12 prompts, batches of 5)
    calls = iter(range(10**6))

    def half(ps):
        return [a if next(calls) % 2 == 0 else "00x" for a in perfect(ps)]

    assert passkey_accuracy(half, SPEC, LENGTH) == {24: 0.5, 40: 0.5, 100: 0.5}


class CopyBack(nn.Module):
    """A hand-made LM whose next token is the one ``distance`` before it (``distance - 1``
    before the last input token): a perfect retriever at that distance, never right at another."""

    def __init__(self, vocab: int, distance: int) -> None:
        super().__init__()
        self.vocab, self.distance = vocab, distance
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, ids, last_only=False):
        src = ids[:, -self.distance]  # (B,) the token distance - 1 before the last
        logits = nn.functional.one_hot(src, self.vocab).float()[:, None]  # (B, 1, V)
        return type("Out", (), {"logits": logits})()


def test_greedy_answers_of_a_model_that_copies_from_exactly_one_distance():
    tok = CharTokenizer(sorted(set(passkey_text(0, 50_000))))
    acc = passkey_accuracy(greedy_answerer(CopyBack(tok.vocab_size, 40), tok), SPEC, LENGTH)
    assert acc == {24: 0.0, 40: 1.0, 100: 0.0}


def test_report_cells_and_window_reach():
    runs = [{"passkey": {"24": 1.0, "40": 0.5}}, {"passkey": {"24": 0.5, "40": 0.5}}]
    assert accuracy_cells(runs, [24, 40]) == ["0.75 ± 0.35", "0.50 ± 0.00"]
    assert accuracy_cells([{"passkey": None}], [24]) == ["n/a"]
    exp = experiment_from_dict(passkey_experiment())
    models = [exp.config(v, 1).model for v in exp.variants]
    assert window_reach(models) == 2 * (8 - 1) + 1
    assert window_reach(models[:1]) is None


# ------------------------------------------------------------------------------- the spec


def passkey_experiment(**passkey) -> dict:
    base = copy.deepcopy(TINY)
    base.pop("name")
    base["model"]["max_seq_len"] = 128
    base["data"] = {"corpus": "passkey"}
    return {
        "name": "pk",
        "base": base,
        "variants": {
            "full": {},
            "window": {"model.attention.mask": "sliding_window", "model.attention.window": 8},
        },
        "seeds": [1, 2],
        "budget": {"steps": 2},
        "eval": {"passkey": {"distances": [24, 64], "samples": 10, **passkey}},
    }


def test_a_valid_spec_and_its_smoke_version():
    exp = experiment_from_dict(passkey_experiment(seed=4))
    assert exp.eval.passkey == PasskeyEval([24, 64], 10, 4, 50)
    assert exp.smoke().eval.passkey.samples == 2


BAD = [
    ({"distances": "24"}, "eval.passkey.distances must be a list"),
    ({"distances": []}, "eval.passkey.distances must be a list"),
    ({"distances": [24, True]}, "eval.passkey.distances must be a list"),
    ({"distances": [64, 24]}, "eval.passkey.distances must be strictly ascending"),
    ({"distances": [24, 24]}, "eval.passkey.distances must be strictly ascending"),
    ({"distances": [MIN_DISTANCE - 1]}, f"eval.passkey.distances must be .*>= {MIN_DISTANCE}"),
    ({"distances": [24, 200]}, "eval.passkey.distances go to 200, past the farthest key"),
    ({"samples": 0}, r"eval.passkey.samples must be an integer in \[1, 10,000\]"),
    ({"samples": 2.5}, "eval.passkey.samples must be an integer"),
    ({"seed": -1}, "eval.passkey.seed must be an integer"),
    ({"batch_size": False}, "eval.passkey.batch_size must be an integer"),
    ({"lengths": [24]}, "eval.passkey.lengths is unknown; allowed: distances"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_passkey_spec_is_one_config_error_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        experiment_from_dict(passkey_experiment(**change))


def test_passkey_needs_the_passkey_corpus_and_a_mapping():
    exp = passkey_experiment()
    exp["base"]["data"]["corpus"] = "tinyshakespeare"
    with pytest.raises(ConfigError, match="'full': eval.passkey needs data.corpus: passkey or"):
        experiment_from_dict(exp)
    exp = passkey_experiment()
    exp["eval"]["passkey"] = [24]
    with pytest.raises(ConfigError, match="eval.passkey must be a mapping"):
        experiment_from_dict(exp)


def test_bad_passkey_spec_from_the_cli_is_one_error_line(tmp_path, capsys):
    import yaml

    path = tmp_path / "pk.yaml"
    path.write_text(yaml.safe_dump(passkey_experiment(samples=-3)), encoding="utf-8")
    code, _, err = run_cli(capsys, "compare", path, "--out", tmp_path / "out")
    assert_one_error(code, err, str(path), "eval.passkey.samples")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- recall corpus


def _recall_value(prompt: str, key: str) -> tuple[int, str]:
    """Index of the value of ``key``'s only fact in ``prompt``, and that value."""
    assert prompt.count(f"={key}") == 1
    at = prompt.index(f"={key}") + 2
    return at, prompt[at]


def test_recall_generator_is_deterministic_from_its_seed():
    assert recall_text(5, 4000) == recall_text(5, 4000)
    assert recall_text(5, 4000) != recall_text(6, 4000)
    a, b = random.Random(3), random.Random(3)
    assert recall_sample(a, 128, 64) == recall_sample(b, 128, 64)


@pytest.mark.parametrize("length,distance", [(128, 4), (128, 8), (128, 64), (128, 124), (131, 128)])
def test_recall_answer_lies_at_the_stated_distance_and_its_fact_is_unique(length, distance):
    rng = random.Random(0)
    for _ in range(20):
        s = recall_sample(rng, length, distance)
        assert len(s.prompt) == length and s.prompt[-2] == ASK
        key = s.prompt[-1]
        assert key in KEYS and s.prompt.count(key) == 2  # its fact and the final query only
        at, value = _recall_value(s.prompt, key)
        assert length - at == distance and value == s.answer and value.isdigit()
        # the distractors: every other query is answered by its own key's earlier fact
        for m in re.finditer(r"\?([a-z])(\d)", s.prompt):
            fact_at, fact_value = _recall_value(s.prompt, m.group(1))
            assert fact_at < m.start() and fact_value == m.group(2)
        assert s.prompt.count("?") > 3 and s.prompt.count("=") > 3  # distractors, not filler


def test_recall_documents_answer_every_query_from_its_fact_within_the_gap_range():
    docs = recall_text(0, 20_000).split("\n")[:-1]
    gaps, answers = [], 0
    for doc in docs:
        assert len(doc) == DOC_SLOTS * SLOT
        for i in range(0, len(doc), SLOT):
            slot = doc[i : i + SLOT]
            assert slot == FILLER or re.fullmatch(r"[=?][a-z]\d ", slot), slot
            if slot[0] == ASK:
                fact_at, value = _recall_value(doc, slot[1])
                assert value == slot[2] and doc.count(slot[1]) == 2
                gaps.append((i + 2 - fact_at) // SLOT)
                answers += 1
    assert min(gaps) == 1 and max(gaps) == MAX_GAP
    assert answers / (len(docs) * (DOC_SLOTS * SLOT + 1)) > 0.09  # dense: ~1 answer in 9 chars


def test_recall_distances_that_do_not_fit_are_refused():
    for bad in (0, 3, 6, 126):
        with pytest.raises(ConfigError, match="recall distance"):
            recall_sample(random.Random(0), 128, bad)
    assert farthest(128) == 124 and farthest(129) == 124 and farthest(130) == 128


def test_recall_is_a_corpus_name(monkeypatch):
    import lmlab.data.recall as recall

    monkeypatch.setattr(recall, "TRAIN_CHARS", 20_000)  # the real 2M take seconds to generate
    corpus = load_corpus("recall")
    assert set(corpus.splits) == {"train", "val"} and corpus.split("val").count(ASK) > 5000
    assert corpus.split("train") == recall_text(recall.TRAIN_SEED, 20_000)


def test_greedy_answers_of_a_copier_on_recall_prompts():
    tok = CharTokenizer(sorted(set(recall_text(0, 50_000))))
    spec = PasskeyEval(distances=[8, 40, 100], samples=12, seed=3, batch_size=5)
    acc = passkey_accuracy(greedy_answerer(CopyBack(tok.vocab_size, 40), tok), spec, 128, "recall")
    # right at its distance; elsewhere it copies a distractor's value (right by chance only)
    assert acc[40] == 1.0 and acc[8] < 0.5 and acc[100] < 0.5

    def lookup(prompts):
        return [re.search("=" + p[-1] + r"(\d)", p).group(1) for p in prompts]

    assert passkey_accuracy(lookup, spec, 128, "recall") == {8: 1.0, 40: 1.0, 100: 1.0}


def test_recall_spec_checks_its_distances():
    exp = passkey_experiment()
    exp["base"]["data"]["corpus"] = "recall"
    exp["eval"]["passkey"]["distances"] = [8, 64, 124]
    assert experiment_from_dict(exp).eval.passkey.distances == [8, 64, 124]
    for bad, message in (([8, 66], "multiples of 4"), ([8, 128], "past the farthest key")):
        exp["eval"]["passkey"]["distances"] = bad
        with pytest.raises(ConfigError, match=message):
            experiment_from_dict(exp)
