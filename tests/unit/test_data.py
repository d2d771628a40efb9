from pathlib import Path

import numpy as np
import pytest

from lmlab.config import TokenizerConfig
from lmlab.data.corpus import load_corpus, read_text, split_text
from lmlab.data.dataset import batch_rng, build_token_cache, check_split_length, sample_batch
from lmlab.data.tokenizer import fit_tokenizer
from lmlab.errors import DataError


def test_tinyshakespeare_split_is_the_customary_90_10():
    c = load_corpus("tinyshakespeare")
    n = len(c.splits["train"]) + len(c.splits["val"])
    assert n == 1_115_394
    assert len(c.splits["train"]) == int(n * 0.9)
    assert c.splits["train"].startswith("First Citizen:")
    with pytest.raises(DataError, match="has no 'test' split; it has: train, val"):
        c.split("test")


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_memmap_equals_the_tokenised_text(tmp_path: Path, kind: str):
    text = "Hello there, 世界!\n" * 50 + "The end.\n"
    f = tmp_path / "c.txt"
    f.write_text(text, encoding="utf-8")
    corpus = load_corpus(f)
    tok = fit_tokenizer(corpus.splits, TokenizerConfig(kind=kind, vocab_size=300))
    arrays = build_token_cache(corpus, tok, tmp_path / "cache")
    for split, arr in arrays.items():
        assert arr.tolist() == tok.encode(corpus.splits[split])
        assert tok.decode(arr.tolist()) == corpus.splits[split]
    assert (tmp_path / "cache" / "train.bin").stat().st_size == 2 * len(arrays["train"])
    # Reused while the corpus is unchanged; rebuilt when it changes.
    mtime = (tmp_path / "cache" / "train.bin").stat().st_mtime_ns
    build_token_cache(corpus, tok, tmp_path / "cache")
    assert (tmp_path / "cache" / "train.bin").stat().st_mtime_ns == mtime


def test_folder_corpus_has_test_split(tmp_path: Path):
    (tmp_path / "train.txt").write_text("a b c\n" * 20)
    (tmp_path / "valid.txt").write_text("b c a\n" * 5)
    (tmp_path / "test.txt").write_text("c a b\n" * 5)
    c = load_corpus(tmp_path)
    assert set(c.splits) == {"train", "val", "test"}
    assert c.split("test") == "c a b\n" * 5


def test_bad_corpus_files_get_clear_messages(tmp_path: Path):
    with pytest.raises(DataError, match=r"corpus file not found: .*missing\.txt"):
        read_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="is empty"):
        read_text(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"not UTF-8 text \(invalid byte 0xe9 at byte offset 3\)"):
        read_text(latin)
    with pytest.raises(DataError, match="neither a bundled corpus"):
        load_corpus("shakespear")
    with pytest.raises(DataError, match="has no train.txt"):
        load_corpus(tmp_path)
    with pytest.raises(DataError, match="too short to split"):
        split_text("a", 0.1)


def test_batches_are_shifted_windows_and_a_pure_function_of_the_step():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = sample_batch(tokens, 4, 16, batch_rng(1, 7, 0))
    assert x.shape == y.shape == (4, 16)
    assert (y == x + 1).all()
    x2, _ = sample_batch(tokens, 4, 16, batch_rng(1, 7, 0))
    x3, _ = sample_batch(tokens, 4, 16, batch_rng(1, 8, 0))
    assert (x == x2).all() and not (x == x3).all()
    with pytest.raises(DataError, match="fewer than one training window"):
        check_split_length(tokens[:10], 16, "val")
