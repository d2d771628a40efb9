"""Tiny encoder (BERT) configs shared by the encoder tests."""

from __future__ import annotations

import copy

from lmlab.config import ModelConfig, RunConfig, config_from_dict

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
    """The tiny test run (conftest.TINY) as a BERT trained by masked language modelling."""
    from conftest import TINY

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
