"""Tiny lmlab run configs shared by the tests: the decoder-only TINY run, its ``--set`` form for
CLI tests, a BERT-style encoder and an encoder-decoder on a small reverse task.

Every tiny config is built from :data:`TINY` (a few seconds of CPU training), so the tests agree on
one small model; keyword arguments override single sections or fields.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from lmlab.config import ModelConfig, RunConfig, config_from_dict
from lmlab.data.pairs import pairs_text, reverse_pairs

TINY = {
    "name": "tiny",
    "model": {"d_model": 32, "n_layers": 2, "max_seq_len": 32, "attention": {"n_heads": 4}},
    "train": {
        "batch_size": 4,
        "eval_every": 10,
        "eval_batches": 2,
        "warmup_steps": 3,
        "log_every": 1,
        "checkpoint_interval_s": 3600.0,
        "lr": 3e-3,
        "precision": "fp32",
        # benchmarks/gpu_check.sh sets LMLAB_TEST_DEVICE=cuda to train the shared runs on a GPU
        "device": os.environ.get("LMLAB_TEST_DEVICE", "cpu"),
    },
}


def tiny_config(**sections: dict) -> RunConfig:
    """The tiny test config, with nested sections merged over it."""
    data = copy.deepcopy(TINY)
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return config_from_dict(data).validate()


def tiny_model_config(vocab_size: int = 50, **model: object) -> ModelConfig:
    """A validated tiny ModelConfig with ``vocab_size`` set; keyword fields override."""
    cfg = tiny_config(model=dict(TINY["model"], **model)).model
    cfg.vocab_size = vocab_size
    return cfg


# ---------------------------------------------------------------------------- --set forms


def tiny_set(*keys: str) -> list[str]:
    """``--set KEY=VALUE`` pairs for the dotted ``keys`` of :data:`TINY`, in the order given
    (``tiny_set("model.d_model")`` is ``["--set", "model.d_model=32"]``)."""
    argv: list[str] = []
    for key in keys:
        value: object = TINY
        for part in key.split("."):
            assert isinstance(value, dict), key
            value = value[part]
        argv += ["--set", f"{key}={value}"]
    return argv


MODEL_KEYS = ("model.d_model", "model.n_layers", "model.max_seq_len")
# The CLI form of TINY (less its device and checkpoint interval), for in-process CLI runs.
TINY_SET = tiny_set(
    *MODEL_KEYS,
    "model.attention.n_heads",
    "train.batch_size",
    "train.eval_every",
    "train.eval_batches",
    "train.log_every",
    "train.warmup_steps",
    "train.lr",
    "train.precision",
)
# A short ``lmlab train`` (default heads, lr and eval interval; no progress bar), for the tests
# that interrupt, resume or race training runs.
TRAIN_SET = [
    *tiny_set(
        *MODEL_KEYS,
        "train.batch_size",
        "train.eval_batches",
        "train.log_every",
        "train.precision",
        "train.warmup_steps",
    ),
    "--no-progress",
]


# ---------------------------------------------------------------------------- encoder (BERT)

ENCODER = {
    "model": {
        "kind": "encoder",
        "attention": {"n_heads": 4, "mask": "bidirectional", "bias": True},
        "position": {"kind": "learned"},
        "block": {"kind": "post"},
    },
    "data": {"tokenizer": {"kind": "wordlevel", "vocab_size": 512}},
}


def encoder_run_config(**train: object) -> RunConfig:
    """The tiny test run (TINY) as a BERT trained by masked language modelling."""
    data = copy.deepcopy(TINY)
    data["model"].update(copy.deepcopy(ENCODER["model"]))
    data["data"] = copy.deepcopy(ENCODER["data"])
    data["train"].update(train)
    return config_from_dict(data).validate()


def encoder_config(vocab_size: int = 50, **model: object) -> ModelConfig:
    """A validated tiny encoder ModelConfig with ``vocab_size`` set; keyword fields override."""
    cfg = encoder_run_config()
    data = cfg.to_dict()
    data["model"].update(model)
    m = config_from_dict(data).validate().model
    m.vocab_size = vocab_size
    return m


# ---------------------------------------------------------------------------- encoder-decoder

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
    """The tiny test run (TINY) as an encoder-decoder on ``corpus`` with a no-merge byte-level
    BPE (one token per character) and <pad> <unk> <s> </s>."""
    data = copy.deepcopy(TINY)
    data["model"].update(copy.deepcopy(SEQ2SEQ))
    data["data"] = {
        "corpus": str(corpus),
        "val_fraction": 0.1,
        "tokenizer": {"kind": "bpe", "vocab_size": 260, "special_tokens": "seq2seq"},
    }
    data["train"].update({"objective": objective, "batch_size": 16, **train})
    return config_from_dict(data).validate()
