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


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def build_token_cache(
    corpus: Corpus, tokenizer: Tokenizer, folder: str | Path
) -> dict[str, np.memmap]:
    """Tokenise every split of ``corpus`` into ``folder`` (once; reused while the corpus
    fingerprint and vocabulary size match) and return read-only memmaps, split -> (N,) ids."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    fp = corpus.fingerprint()
    dtype = token_dtype(tokenizer.vocab_size)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if not (
        meta and meta.get("fingerprint") == fp and meta.get("vocab_size") == tokenizer.vocab_size
    ):
        counts = {}
        for name, text in corpus.splits.items():
            ids = np.asarray(tokenizer.encode(text), dtype=dtype)
            tmp = out / f"{name}.bin.tmp"
            ids.tofile(tmp)
            os.replace(tmp, out / f"{name}.bin")
            counts[name] = int(ids.size)
        meta = {
            "fingerprint": fp,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "tokens": counts,
        }
        tmp = out / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, meta_path)
    return {
        name: np.memmap(out / f"{name}.bin", dtype=np.dtype(meta["dtype"]), mode="r")
        for name in meta["tokens"]
    }


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
