"""Token ids cached on disk as NumPy memmaps, and random training batches drawn from them.

Layout of a token cache folder (``RUN/data/``): ``<split>.bin`` (uint16 when the vocabulary fits,
else uint32) and ``meta.json`` (dtype, token counts, the corpus fingerprint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from lmlab.data.corpus import Corpus
from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import DataError
from lmlab.fsutil import check_free_space, writing


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def build_token_cache(
    corpus: Corpus, tokenizer: Tokenizer, folder: str | Path
) -> dict[str, np.memmap]:
    """Tokenise every split of ``corpus`` into ``folder`` (once; reused while the corpus
    fingerprint and vocabulary size match) and return read-only memmaps, split -> (N,) ids.

    The free space is checked before writing (n_tokens x itemsize bytes). Raises LmlabError
    naming the folder and the bytes needed for a full disk or a read-only folder; ``meta.json``
    is written last, so a cache left half-written is rebuilt by the next run."""
    out = Path(folder)
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    fp = corpus.fingerprint()
    dtype = token_dtype(tokenizer.vocab_size)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if not (
        meta and meta.get("fingerprint") == fp and meta.get("vocab_size") == tokenizer.vocab_size
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
        _write_atomic(out, {"meta.json": json.dumps(meta, indent=1).encode()}, needed)
    return {
        name: np.memmap(out / f"{name}.bin", dtype=np.dtype(meta["dtype"]), mode="r")
        for name in meta["tokens"]
    }


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
    tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x (B, T) int64 inputs and y (B, T) int64 next-token targets."""
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def batch_rng(
    seed: int, step: int, micro: int, rank: int = 0, stream: int = 0
) -> np.random.Generator:
    """The generator for one micro-batch: a pure function of (seed, step, micro, rank, stream),
    so resuming at any step redraws exactly the batches an uninterrupted run would see."""
    return np.random.default_rng([seed, stream, step, micro, rank])
