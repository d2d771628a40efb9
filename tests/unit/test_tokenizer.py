from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmlab.config import TokenizerConfig
from lmlab.data.corpus import load_corpus
from lmlab.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    fit_tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from lmlab.errors import DataError

SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    "满纸荒唐言，一把辛酸泪！都云作者痴，谁解其中味？\n"
    "Emoji 🎭 and accents: café, naïve, Ωmega.\n"
) * 20


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> BPETokenizer:
    tok = train_tokenizer(SAMPLE, TokenizerConfig(kind="bpe", vocab_size=400))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, BPETokenizer)
    return loaded


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text())
def test_bpe_round_trips_any_unicode_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_bpe_learns_merges_and_has_an_end_token(bpe):
    assert 300 < bpe.vocab_size <= 400  # capped at vocab_size; a small text runs out of merges
    assert bpe.eos_id is not None
    assert len(bpe.encode("Before we proceed")) < len("Before we proceed")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=sorted(set(SAMPLE))))
def test_char_round_trips_text_over_its_alphabet(text):
    tok = CharTokenizer.train(SAMPLE, TokenizerConfig())
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_char_vocabulary_is_sorted_and_saved_as_tokenizer_json(tmp_path: Path):
    tok = CharTokenizer.train("cab\n", TokenizerConfig())
    assert tok.chars == ["\n", "a", "b", "c"] and tok.eos_id is None
    tok.save(tmp_path / "tokenizer.json")
    back = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    from tokenizers import Tokenizer  # the file is a genuine Hugging Face tokenizer.json

    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("cab").ids == [3, 1, 2]


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.train("hello world", TokenizerConfig())
    with pytest.raises(DataError, match=r"2 character\(s\) outside .*'Z', 'é'"):
        tok.encode("hello Zé")


def test_tinyshakespeare_has_65_characters_over_all_splits():
    tok = fit_tokenizer(load_corpus("tinyshakespeare").splits, TokenizerConfig())
    assert tok.vocab_size == 65


def test_corrupt_tokenizer_file(tmp_path: Path):
    p = tmp_path / "tokenizer.json"
    p.write_text("{not json")
    with pytest.raises(DataError, match="corrupt or not a tokenizer.json"):
        load_tokenizer(p)
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "missing.json")
