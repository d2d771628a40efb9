"""Bad or awkward text corpora (tests/catalogue/README.md)."""

from __future__ import annotations

from pathlib import Path

from lmlab.config import TokenizerConfig
from lmlab.data.corpus import load_corpus
from lmlab.data.tokenizer import fit_tokenizer

# line endings


def test_windows_and_old_mac_line_endings_become_newlines(tmp_path: Path):
    """A CRLF (or CR) corpus reads as LF text: no tokenizer learns "\\r", so a model trained
    on it ends lines with "\\n" and ``--stop "\\n\\n"`` can fire."""
    lines = ["To be, or not to be:", "", "that is the question."] * 20
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes("\r\n".join(lines).encode())
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.txt").write_bytes("\r".join(lines).encode())  # old Mac: lone CR
    (folder / "valid.txt").write_bytes(b"a\r\nb\r\n")
    for source in (crlf, folder):
        corpus = load_corpus(source)
        assert all("\r" not in text for text in corpus.splits.values()), source
        assert "\n\n" in corpus.split("train")
        char = fit_tokenizer(corpus.splits, TokenizerConfig(kind="char"))
        assert "\r" not in char.chars
