"""``data.loss_on: answers``: the LM loss over the answer tokens of the synthetic retrieval
corpora only (lmlab.data.answers). The mask marks exactly the answers; the loss equals a float64
cross-entropy over those positions alone; the default (``all``) draws the same batches and
gives the same loss bit for bit; corpora without answers, other tokenizers and other objectives
are refused by name."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmlab.config import config_from_dict
from lmlab.data import passkey, recall
from lmlab.data.answers import token_answers
from lmlab.data.dataset import batch_rng, sample_batch
from lmlab.data.tokenizer import CharTokenizer
from lmlab.errors import ConfigError, DataError
from lmlab.models.build import build_model
from lmlab.training.objectives import CausalLM
from tests.helpers import TINY, assert_one_error, encoder_run_config, run_cli, tiny_config

SEQ = 32


@pytest.fixture(scope="module")
def recall_data():
    """Text, char tokenizer, token ids and a tiny decoder (module-shared)."""
    text = recall.recall_text(0, 20_000)
    tok = CharTokenizer(sorted(set(text)))
    ids = np.asarray(tok.encode(text), dtype=np.uint16)
    cfg = tiny_config(data={"corpus": "recall", "loss_on": "answers"})
    cfg.model.vocab_size = tok.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    return text, tok, ids, cfg, model


def test_recall_mask_marks_exactly_the_value_of_every_query():
    text = recall.recall_text(3, 5_000)
    mask = recall.answer_mask(text)
    at = np.flatnonzero(mask)
    assert len(at) == text.count(recall.ASK) > 300
    for i in at:  # "?kv": the value two characters after the question mark
        assert text[i - 2] == recall.ASK and text[i - 1] in recall.KEYS and text[i].isdigit()
    assert not any(mask[i] for i in range(len(text)) if text[i - 2 : i - 1] != recall.ASK)


def test_passkey_mask_marks_exactly_the_key_digits_after_each_question():
    rng = random.Random(4)
    docs = [passkey.passkey_document(rng, d) for d in (20, 57, 140)]
    text = "".join(docs)
    mask = passkey.answer_mask(text)
    marked = [text[i] for i in np.flatnonzero(mask)]
    keys = [d[len(d) - 2 - passkey.KEY_LEN : len(d) - 2] for d in docs]  # "...? K.\n"
    assert "".join(marked) == "".join(keys) and len(marked) == 3 * passkey.KEY_LEN


def test_token_answers_refuses_a_tokenizer_that_is_not_one_token_per_character():
    class Pairs(CharTokenizer):
        def decode(self, ids):  # two characters per token
            return "".join(self.chars[i] * 2 for i in ids)

    tok = Pairs(list("=?. abc0123"))
    with pytest.raises(DataError, match="one token per character.*kind=char"):
        token_answers("recall", tok, np.asarray(tok.encode("=a1 ?a1 ")))


def test_answer_loss_is_the_cross_entropy_over_the_answer_positions_only(recall_data):
    text, tok, ids, cfg, model = recall_data
    obj = CausalLM(cfg, tok, {"train": ids}, SEQ)
    batch = obj.batch("train", 4, batch_rng(7, 3, 0))
    x, y_all = sample_batch(ids, 4, SEQ, batch_rng(7, 3, 0))  # the same windows, every target
    assert torch.equal(batch["input_ids"], x)
    # hand computation: the answer positions found from the text, float64 log-softmax
    starts = batch_rng(7, 3, 0).integers(0, len(ids) - SEQ, size=4)
    # target t of a window at s is text[s + t + 1]: an answer when text[s + t - 1] is "?"
    answer = torch.tensor(
        [[s + t >= 1 and text[s + t - 1] == recall.ASK for t in range(SEQ)] for s in starts]
    )
    assert 4 <= int(answer.sum()) <= 4 * SEQ // 4  # about one target in nine
    with torch.no_grad():
        loss = model(**batch).loss
        logp = torch.log_softmax(model(input_ids=x).logits.double(), dim=-1)
    want = -logp.gather(-1, y_all.unsqueeze(-1)).squeeze(-1)[answer].mean()
    assert torch.equal(batch["targets"] != -100, answer)
    assert torch.equal(batch["targets"][answer], y_all[answer])
    assert abs(float(loss) - float(want)) < 1e-6
    full = -logp.gather(-1, y_all.unsqueeze(-1)).squeeze(-1).mean()
    assert abs(float(loss) - float(full)) > 1e-3  # the mask changes the loss


def test_default_loss_on_all_is_the_unmasked_batch_and_loss_bit_for_bit(recall_data):
    _, tok, ids, cfg, model = recall_data
    plain = tiny_config(data={"corpus": "recall"})
    assert plain.data.loss_on == "all" and "loss_on" not in TINY.get("data", {})
    obj = CausalLM(plain, tok, {"train": ids}, SEQ)
    assert obj.answers is None
    batch = obj.batch("train", 4, batch_rng(7, 3, 0))
    x, y = sample_batch(ids, 4, SEQ, batch_rng(7, 3, 0))
    assert torch.equal(batch["input_ids"], x) and torch.equal(batch["targets"], y)
    with torch.no_grad():
        got = model(**batch).loss
        want = torch.nn.functional.cross_entropy(
            model(input_ids=x).logits.float().view(-1, tok.vocab_size), y.reshape(-1)
        )
    assert torch.equal(got, want)


def test_a_batch_without_answers_is_redrawn_from_the_same_generator(recall_data):
    _, tok, ids, cfg, _ = recall_data
    obj = CausalLM(cfg, tok, {"train": ids}, 2)  # 2-token windows: most hold no answer
    b = obj.batch("train", 1, batch_rng(0, 0, 0))
    assert int((b["targets"] != -100).sum()) >= 1
    obj.answers = {"train": np.zeros(len(ids), dtype=bool)}
    with pytest.raises(DataError, match="100 batches of the train split in a row held no answer"):
        obj.batch("train", 1, batch_rng(0, 0, 0))


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"loss_on": "answers"},
            "data.loss_on=answers needs a corpus with answer positions "
            r"\(passkey, recall\); data.corpus 'tinyshakespeare' has none",
        ),
        ({"corpus": "recall", "loss_on": "answer"}, "data.loss_on"),
        (
            {"corpus": "recall", "loss_on": "answers", "tokenizer": {"kind": "bpe"}},
            "data.loss_on=answers needs data.tokenizer.kind=char",
        ),
    ],
)
def test_loss_on_answers_is_refused_where_there_are_no_answers(data, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(data=data)


def test_loss_on_answers_is_refused_for_an_objective_with_targets_of_its_own():
    cfg = encoder_run_config()
    raw = cfg.to_dict()
    raw["data"].update(corpus="recall", loss_on="answers")
    raw["data"]["tokenizer"]["kind"] = "char"
    with pytest.raises(
        ConfigError, match="data.loss_on=answers applies to train.objective=clm only, not mlm"
    ):
        config_from_dict(raw).validate()


def test_loss_on_answers_on_a_plain_corpus_from_the_cli_is_one_error_line(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "train", "--set", "data.loss_on=answers", "--out", tmp_path / "run"
    )
    assert_one_error(code, err, "data.loss_on=answers", "tinyshakespeare")
    assert not (tmp_path / "run").exists()
