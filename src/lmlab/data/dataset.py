"""Token ids cached on disk as NumPy memmaps, and random training batches drawn from them.

Layout of a token cache folder (``RUN/data/``): ``<split>.bin`` (uint16 when the vocabulary fits,
else uint32) and ``meta.json`` (dtype, token counts, the corpus fingerprint). Reading checks
meta.json's fields (:func:`read_token_meta`), each ``.bin`` file's size against its token count
and every id against the vocabulary (:func:`open_token_cache`) before a batch is drawn.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmlab.data.corpus import Corpus
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError
from lmlab.fsutil import check_free_space, writing
from lmlab.safeio import MiB, inside, read_json_object, regular_file

META_FILE = "meta.json"
MAX_TOKENS = 1 << 50


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def build_token_cache(
    corpus: Corpus, tokenizer: Tokenizer, folder: str | Path, resuming: bool = False
) -> dict[str, np.ndarray]:
    """Tokenise every split of ``corpus`` into ``folder`` (once; reused while the corpus
    fingerprint and vocabulary size match) and return read-only memmaps, split -> (N,) ids.

    The free space is checked before writing (n_tokens x itemsize bytes). Raises LmlabError
    naming the folder and the bytes needed for a full disk or a read-only folder; ``meta.json``
    is written last, so a cache left half-written is rebuilt by the next run.

    ``resuming``: the run continues from a checkpoint, so a cache built from other text is
    refused (DataError naming the corpus) instead of being rebuilt: a resumed run trains on the
    text it started with (a missing cache is rebuilt; it then must come from the same text).
    A ``folder`` that is a symlink leading outside its parent (the run folder) is refused."""
    out = Path(folder)
    if os.path.lexists(out):  # a data/ that is a symlink out: never read or written through
        inside(
            out.parent,
            out.name,
            "token cache folder",
            DataError,
            outside=(
                f"token cache folder {out} leads outside {out.parent} (a symlink); lmlab reads and "
                "writes a run's token cache only inside its folder"
            ),
        )
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    fp = corpus.fingerprint()
    dtype = token_dtype(tokenizer.vocab_size)
    meta = read_token_meta(out)
    if resuming and meta is not None and meta["fingerprint"] != fp:
        raise DataError(
            f"the corpus {corpus.source} is not the text this run started with (its fingerprint "
            f"differs from {meta_path}); a resumed run keeps its data: restore the corpus, or "
            "start a new run from this one's weights with --init-from"
        )
    if not (
        meta
        and meta["fingerprint"] == fp
        and meta["vocab_size"] == tokenizer.vocab_size
        and set(meta["tokens"]) == set(corpus.splits)
    ):
        encoded = {
            n: np.asarray(tokenizer.encode(t), dtype=dtype) for n, t in corpus.splits.items()
        }
        needed = sum(ids.nbytes for ids in encoded.values())  # n_tokens x itemsize
        check_free_space(out, needed, "the token cache")
        meta = {
            "fingerprint": fp,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "tokens": {name: int(ids.size) for name, ids in encoded.items()},
        }
        if meta_path.exists():  # the old cache is invalid from the first file replaced on
            meta_path.unlink()
        _write_atomic(out, {f"{n}.bin": ids for n, ids in encoded.items()}, needed)
        _write_atomic(out, {META_FILE: json.dumps(meta, indent=1).encode()}, needed)
        return open_token_cache(out, meta, check_ids=False)  # just written from the corpus
    return open_token_cache(out, meta)


def read_token_meta(folder: str | Path) -> dict[str, Any] | None:
    """The token cache's ``meta.json`` (None when there is none), checked: ``fingerprint`` a
    string, ``vocab_size`` a positive integer, ``dtype`` the one :func:`token_dtype` picks for
    it, ``tokens`` an object of split names (letters, digits, ``_``, ``-``) to non-negative
    token counts. Raises DataError naming the file and field (also when it is a symlink out of
    the folder)."""
    base = Path(folder)
    if not os.path.lexists(base / META_FILE):
        return None
    path = inside(base, META_FILE, "token cache", DataError)
    meta = read_json_object(path, "token cache metadata", 1 * MiB, DataError)

    def bad(field: str, want: str) -> DataError:
        shown = repr(meta.get(field))[:60]
        return DataError(
            f"token cache metadata {path}: {field} must be {want}, not {shown}; delete {base} "
            "to rebuild the cache from the corpus"
        )

    if not isinstance(meta.get("fingerprint"), str):
        raise bad("fingerprint", "a string")
    vocab = meta.get("vocab_size")
    if not (isinstance(vocab, int) and not isinstance(vocab, bool) and 0 < vocab <= 1 << 32):
        raise bad("vocab_size", "a positive integer")
    if meta.get("dtype") != token_dtype(vocab).name:
        raise bad("dtype", f"{token_dtype(vocab).name!r} for vocab_size {vocab}")
    tokens = meta.get("tokens")
    if not isinstance(tokens, dict) or not tokens:
        raise bad("tokens", "an object of split name -> token count")
    for name, count in tokens.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise bad("tokens", "keyed by split names (letters, digits, _ and -)")
        if not (
            isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_TOKENS
        ):
            raise bad("tokens", f"non-negative token counts (tokens.{name} is not)")
    return meta


def open_token_cache(
    folder: str | Path, meta: dict[str, Any], check_ids: bool = True
) -> dict[str, np.ndarray]:
    """Read-only memmaps of the splits ``meta`` (from :func:`read_token_meta`) lists, split ->
    (N,) ids. Each ``<split>.bin`` must be a regular file inside ``folder`` of exactly N x the
    dtype's bytes; with ``check_ids``, every id must be below ``vocab_size`` (one pass over the
    file). Raises DataError naming the file and what differs."""
    base = Path(folder)
    dtype = np.dtype(meta["dtype"])
    out: dict[str, np.ndarray] = {}
    for name, count in meta["tokens"].items():
        path = inside(base, f"{name}.bin", "token cache", DataError)
        size = regular_file(path, "token cache file", None, DataError).st_size
        if size != count * dtype.itemsize:
            raise DataError(
                f"token cache file {path} is {size:,} bytes, but {base / META_FILE} says "
                f"tokens.{name} is {count:,} {dtype.name} ids ({count * dtype.itemsize:,} "
                f"bytes); delete {base} to rebuild the cache from the corpus"
            )
        ids = (
            np.memmap(path, dtype=dtype, mode="r", shape=(count,))
            if count
            else np.zeros(0, dtype)  # mmap cannot map an empty file
        )
        if check_ids and count and int(ids.max()) >= meta["vocab_size"]:
            raise DataError(
                f"token cache file {path} holds id {int(ids.max())}, outside the vocabulary of "
                f"{meta['vocab_size']} in {base / META_FILE}; delete {base} to rebuild the cache"
            )
        out[name] = ids
    return out


def _write_atomic(folder: Path, files: dict[str, bytes | np.ndarray], needed: int) -> None:
    """Write each name -> bytes into ``folder`` through a temporary file and a rename. A full
    disk or read-only folder is one LmlabError naming the file and ``needed``; the temporary
    file is removed and the file it would replace stays as it was."""
    for name, data in files.items():
        tmp = folder / f"{name}.tmp"
        try:
            with writing(tmp, needed):
                with open(tmp, "wb") as fh:
                    if isinstance(data, np.ndarray):
                        data.tofile(fh)
                    else:
                        fh.write(data)
                os.replace(tmp, folder / name)
        finally:
            tmp.unlink(missing_ok=True)


def check_split_length(tokens: np.ndarray, seq_len: int, split: str) -> None:
    """Raise DataError if a split holds too few tokens for one (seq_len + 1) window."""
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {split} split has {len(tokens)} tokens, fewer than one training window of "
            f"seq_len + 1 = {seq_len + 1}; use more text or a smaller train.seq_len"
        )


def sample_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    rng: np.random.Generator,
    answers: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x (B, T) int64 inputs and y (B, T) int64 next-token targets.

    ``answers``: (N,) bool over ``tokens`` (:func:`lmlab.data.answers.token_answers`); when
    given, targets whose token is not an answer are -100 (ignored by the loss). The windows are
    the same draws either way."""
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    if answers is None:
        return t[:, :-1], t[:, 1:]
    keep = np.stack([answers[s + 1 : s + seq_len + 1] for s in starts])  # (B, T) bool
    y = torch.where(torch.from_numpy(keep), t[:, 1:], -100)
    return t[:, :-1], y


def batch_rng(
    seed: int, step: int, micro: int, rank: int = 0, stream: int = 0
) -> np.random.Generator:
    """The generator for one micro-batch: a pure function of (seed, step, micro, rank, stream),
    so resuming at any step redraws exactly the batches an uninterrupted run would see."""
    return np.random.default_rng([seed, stream, step, micro, rank])
