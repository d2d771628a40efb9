"""Shared fixtures: tiny configs and one tiny trained run reused by the end-to-end tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["LMLAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmlab-cache-")

from lmlab.config import RunConfig, config_from_dict  # noqa: E402

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
        "device": "cpu",
    },
}


def tiny_config(**sections: dict) -> RunConfig:
    """The tiny test config, with nested sections merged over it."""
    import copy

    data = copy.deepcopy(TINY)
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return config_from_dict(data).validate()


def tiny_model_config(vocab_size: int = 50, **model: object):
    """A validated tiny ModelConfig with ``vocab_size`` set; keyword fields override."""
    cfg = tiny_config(model=dict(TINY["model"], **model)).model
    cfg.vocab_size = vocab_size
    return cfg


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained for 30 steps on tinyshakespeare (shared; do not modify it)."""
    from lmlab.training.trainer import train

    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(tiny_config(train={"max_steps": 30}), out=out, progress=False)
    return out


@pytest.fixture(scope="session")
def seq2seq_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny encoder-decoder trained for 40 seq2seq steps on a small reverse-task TSV
    (tests_helpers_seq2seq; shared, do not modify it)."""
    from tests_helpers_seq2seq import seq2seq_run_config, write_reverse_tsv

    from lmlab.training.trainer import train

    folder = tmp_path_factory.mktemp("runs")
    cfg = seq2seq_run_config(write_reverse_tsv(folder), max_steps=40, eval_every=20)
    train(cfg, out=folder / "s2s", progress=False)
    return folder / "s2s"


@pytest.fixture(scope="session")
def encoder_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT trained for 20 mlm steps on tinyshakespeare (shared; do not modify it)."""
    from tests_helpers_encoder import encoder_run_config

    from lmlab.training.trainer import train

    out = tmp_path_factory.mktemp("runs") / "bert"
    train(encoder_run_config(max_steps=20), out=out, progress=False)
    return out
