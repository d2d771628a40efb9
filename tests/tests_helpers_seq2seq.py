"""Tiny encoder-decoder (seq2seq) run configs shared by the seq2seq training tests."""

from __future__ import annotations

import copy
from pathlib import Path

from lmlab.config import RunConfig, config_from_dict
from lmlab.data.pairs import pairs_text, reverse_pairs

SEQ2SEQ = {
    "kind": "encoder_decoder",
    "max_seq_len": 16,
    "attention": {"n_heads": 4},
    "position": {"kind": "learned"},
}


def write_reverse_tsv(folder: Path, n: int = 240) -> Path:
    """A small reverse task (strings of 3..6 symbols of 'abcd') as a TSV file."""
    splits = reverse_pairs(n_train=n, n_val=0, seed=7, alphabet="abcd", lengths=(3, 6))
    path = folder / "reverse.tsv"
    path.write_text(pairs_text(splits["train"]), encoding="utf-8")
    return path


def seq2seq_run_config(
    corpus: str | Path, objective: str = "seq2seq", **train: object
) -> RunConfig:
    """The tiny test run (conftest.TINY) as an encoder-decoder on ``corpus`` with a no-merge
    byte-level BPE (one token per character) and <pad> <unk> <s> </s>."""
    from conftest import TINY

    data = copy.deepcopy(TINY)
    data["model"].update(copy.deepcopy(SEQ2SEQ))
    data["data"] = {
        "corpus": str(corpus),
        "val_fraction": 0.1,
        "tokenizer": {"kind": "bpe", "vocab_size": 260, "special_tokens": "seq2seq"},
    }
    data["train"].update({"objective": objective, "batch_size": 16, **train})
    return config_from_dict(data).validate()
