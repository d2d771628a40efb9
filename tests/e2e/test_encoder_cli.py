"""An encoder (BERT) run end to end: train with mlm, resume exactly, eval, fill-mask, embed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmlab.training.metrics import read_metrics
from lmlab.training.trainer import train
from tests.helpers import encoder_run_config, run_cli


def test_mlm_training_lowers_the_masked_loss(encoder_run: Path):
    rows = read_metrics(encoder_run)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[0] > math.log(400)  # about uniform over the 512-word vocabulary at step 0
    assert val[-1] < val[0] - 0.3


def test_mlm_resumed_run_retraces_the_uninterrupted_one(tmp_path: Path):
    cfg = encoder_run_config(max_steps=4, eval_every=100, lr_decay_steps=4)
    whole = train(cfg, out=tmp_path / "whole", progress=False)
    half = encoder_run_config(max_steps=2, eval_every=100, lr_decay_steps=4)
    train(half, out=tmp_path / "half", progress=False)
    resumed = train(resume=tmp_path / "half", max_steps=4, progress=False)
    assert resumed.train_loss == whole.train_loss and resumed.val_loss == whole.val_loss


def test_eval_reports_masked_accuracy_and_perplexity_deterministically(encoder_run, capsys):
    code, out, _ = run_cli(capsys, "eval", str(encoder_run), "--json")
    assert code == 0
    res = json.loads(out)
    assert set(res) == {"loss", "perplexity", "masked_accuracy", "masked_tokens", "tokens"}
    assert 0.0 < res["masked_accuracy"] < 1.0 and res["masked_tokens"] > 1000
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))
    assert json.loads(run_cli(capsys, "eval", str(encoder_run), "--json")[1]) == res


def test_fill_mask_prints_top_k_fills_with_descending_probabilities(encoder_run, capsys):
    text = "To be, or not to be, that is the [MASK]."
    code, out, _ = run_cli(capsys, "fill-mask", str(encoder_run), "--text", text, "--json")
    assert code == 0
    (fills,) = json.loads(out)
    assert len(fills) == 5
    probs = [f["probability"] for f in fills]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0
    assert all(f["text"].startswith("To be, or not to be, that is the") for f in fills)
    code, out, _ = run_cli(capsys, "fill-mask", str(encoder_run), "--text", text, "--top-k", "2")
    assert code == 0 and len(out.strip().splitlines()) == 2


def test_fill_mask_fills_several_masks(encoder_run, capsys):
    text = "[MASK] be, or not to [MASK]."
    code, out, _ = run_cli(capsys, "fill-mask", str(encoder_run), "--text", text, "--json")
    assert code == 0 and len(json.loads(out)) == 2


def test_embed_run_mean_pools_and_prints_json_list_of_lists(encoder_run, capsys):
    args = ["embed", str(encoder_run), "--text", " hear me", "--text", " speak, speak."]
    code, out, _ = run_cli(capsys, *args, "--json")
    vectors = json.loads(out)
    assert code == 0 and len(vectors) == 2 and all(len(v) == 32 for v in vectors)
    assert vectors[0] != vectors[1]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "dim 32" in out and len(out.strip().splitlines()) == 2
