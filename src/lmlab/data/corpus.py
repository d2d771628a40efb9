"""Text corpora: the bundled ones, a user's text file, or a folder of splits.

A corpus resolves to named splits of text: ``train`` and ``val`` always, ``test`` where the source
has one. Bundled corpora live in ``lmlab/data/corpora/<name>/`` with their provenance README.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lmlab.errors import DataError
from lmlab.safeio import TEXT_FILE, read_bytes

if TYPE_CHECKING:
    from lmlab.config import DataConfig

CORPORA_DIR = Path(__file__).parent / "corpora"

# Bundled corpus name -> its text file, relative to CORPORA_DIR.
BUNDLED: dict[str, str] = {"tinyshakespeare": "tinyshakespeare/input.txt"}

SPLIT_FILES = {"train": ("train.txt",), "val": ("valid.txt", "val.txt"), "test": ("test.txt",)}


def read_text(path: str | Path) -> str:
    r"""Read a UTF-8 text file of at most :data:`lmlab.safeio.TEXT_FILE` bytes, with ``\r\n``
    (Windows) and lone ``\r`` line endings turned into ``\n`` (so no model learns ``\r`` as a
    token, and ``--stop "\n\n"`` works). Raises DataError if it is missing, a folder, a FIFO,
    device or symlink loop, larger than that, empty, not UTF-8 (naming the byte offset of the
    first bad byte) or binary (holds a NUL byte, which text never does but executables, images
    and archives nearly always do, even when they decode)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{p} is a folder, not a text file")
    raw = read_bytes(p, "corpus file", TEXT_FILE, DataError)  # a regular file, bounded
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise DataError(
            f"{p} looks like a binary file, not text (NUL byte at byte offset {nul}); give a "
            "UTF-8 text file (UTF-16 text: convert it, e.g. iconv -f utf-16 -t utf-8)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}); "
            "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise DataError(f"corpus file {p} is empty")
    return text


@dataclass
class Corpus:
    """Named splits of one corpus. ``source`` is what the user gave; ``files`` what was read."""

    source: str
    splits: dict[str, str]
    files: list[str] = field(default_factory=list)

    def split(self, name: str) -> str:
        """The text of split ``name``; raises DataError listing the splits this corpus has."""
        if name not in self.splits:
            raise DataError(
                f"corpus {self.source!r} has no {name!r} split; it has: {', '.join(self.splits)}"
            )
        return self.splits[name]

    def fingerprint(self) -> str:
        """SHA-256 over all split texts: tells whether a token cache still matches."""
        h = hashlib.sha256()
        for name in sorted(self.splits):
            h.update(name.encode() + b"\0" + self.splits[name].encode("utf-8") + b"\0")
        return h.hexdigest()


def split_text(text: str, val_fraction: float) -> dict[str, str]:
    """The first (1 - val_fraction) of the characters for training, the rest for validation."""
    n = int(len(text) * (1.0 - val_fraction))
    if n == 0 or n == len(text):
        raise DataError(
            f"text of {len(text)} characters is too short to split into train and val "
            f"(val_fraction={val_fraction})"
        )
    return {"train": text[:n], "val": text[n:]}


def load_data(data: DataConfig) -> Corpus:
    """The corpus of a run's ``data`` section: :func:`load_corpus` with its ``val_fraction``
    and, for ``passkey``, its training distance range."""
    return load_corpus(
        data.corpus, data.val_fraction, (data.passkey_min_distance, data.passkey_max_distance)
    )


def load_corpus(
    source: str | Path,
    val_fraction: float = 0.1,
    passkey_distances: tuple[int | None, int | None] = (None, None),
) -> Corpus:
    """Resolve ``source``: a bundled name, ``passkey`` or ``recall`` (generated,
    :mod:`lmlab.data.passkey`, :mod:`lmlab.data.recall`), a text file, or a folder with
    train/valid[/test].txt;
    (source, target) pairs (``synthetic:NAME``, a .tsv or .jsonl file, :mod:`lmlab.data.pairs`)
    become one ``source<TAB>target`` line per pair, split by pair.

    ``passkey_distances``: (min, max) training distances of ``passkey``
    (:func:`lmlab.data.passkey.passkey_splits`; None: its default).

    Raises DataError naming the path when it is missing, empty, or not UTF-8.
    """
    src = str(source)
    from lmlab.data.pairs import is_pairs_source, load_pairs, pairs_text

    if is_pairs_source(src):  # seq2seq pairs: their source<TAB>target lines, split by pair
        pairs = load_pairs(src, val_fraction)
        return Corpus(src, {k: pairs_text(v) for k, v in pairs.items()}, [src])
    if src == "passkey":  # generated: lmlab.data.passkey
        from lmlab.data.passkey import passkey_splits

        return Corpus(src, passkey_splits(*passkey_distances), [])
    if src == "recall":  # generated: lmlab.data.recall
        from lmlab.data.recall import recall_splits

        return Corpus(src, recall_splits(), [])
    if src in BUNDLED:
        path = CORPORA_DIR / BUNDLED[src]
        return Corpus(src, split_text(read_text(path), val_fraction), [str(path)])
    p = Path(src).expanduser()
    if p.is_dir():
        splits: dict[str, str] = {}
        files: list[str] = []
        for name, candidates in SPLIT_FILES.items():
            for cand in candidates:
                if os.path.lexists(p / cand):  # a FIFO or loop is refused by read_text
                    splits[name] = read_text(p / cand)
                    files.append(str(p / cand))
                    break
        if "train" not in splits:
            raise DataError(f"corpus folder {p} has no train.txt")
        if "val" not in splits:
            splits.update(split_text(splits["train"], val_fraction))
        return Corpus(src, splits, files)
    if not p.exists() and "/" not in src and "." not in src:
        raise DataError(
            f"corpus {src!r} is neither a bundled corpus ({', '.join(BUNDLED)}) nor an existing "
            "file or folder"
        )
    return Corpus(src, split_text(read_text(p), val_fraction), [str(p)])
