"""Gradient accumulation weights micro-batches by their target tokens: K micro-batches with
unequal target counts give the gradient and the logged loss of one batch holding them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmlab.models.build import build_model
from lmlab.run import read_run_config
from lmlab.training import loop, trainer
from lmlab.training.objectives import CausalLM
from tests.distributed._uneven import patch_uneven_clm
from tests.helpers import tiny_config


def train_capturing(monkeypatch, out: Path, **train_fields: object) -> list[dict]:
    """Train the tiny config; return, per optimizer step, the gradients (before clipping), the
    weights they were taken at, and the train batches drawn."""
    steps: list[dict] = []
    drawn: list[dict[str, torch.Tensor]] = []
    clip, draw = loop.clip_gradients, CausalLM.batch

    def capture(model, max_norm, params=None):
        steps.append(
            {
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                "weights": {n: p.detach().clone() for n, p in model.state_dict().items()},
                "batches": list(drawn),
            }
        )
        drawn.clear()
        return clip(model, max_norm, params)

    def recording_batch(self, split, batch_size, rng):
        batch = draw(self, split, batch_size, rng)
        if split == "train":
            drawn.append(batch)
        return batch

    monkeypatch.setattr(loop, "clip_gradients", capture)
    monkeypatch.setattr(CausalLM, "batch", recording_batch)
    cfg = tiny_config(train={"max_steps": 2, "eval_every": 100, **train_fields})
    trainer.train(cfg, out=out, progress=False)
    return steps


def train_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_accumulated_unequal_micro_batches_equal_one_batch(monkeypatch, tmp_path, float64):
    k, b = 3, 2
    with monkeypatch.context() as m:
        patch_uneven_clm(m.setattr, parts=1)
        accum = train_capturing(m, tmp_path / "accum", grad_accum_steps=k, batch_size=b)
    with monkeypatch.context() as m:
        patch_uneven_clm(m.setattr, parts=k)
        whole = train_capturing(m, tmp_path / "whole", grad_accum_steps=1, batch_size=k * b)
    counts = [int((mb["targets"] != -100).sum()) for mb in accum[0]["batches"]]
    assert len(set(counts)) > 1, counts  # the micro-batches hold unequal numbers of targets
    joined = torch.cat([mb["targets"] for mb in accum[0]["batches"]])
    assert torch.equal(joined, whole[0]["batches"][0]["targets"])  # the same tokens, one batch
    assert accum[0]["grads"]["embed.weight"].dtype == torch.float64
    for step in range(2):  # step 1 starts from weights the first (weighted) update gave
        for name, grad in whole[step]["grads"].items():
            diff = float((accum[step]["grads"][name] - grad).abs().max())
            assert diff < 1e-6, (step, name, diff)
    got, want = train_losses(tmp_path / "accum"), train_losses(tmp_path / "whole")
    assert got.keys() == want.keys() == {1, 2}
    assert all(abs(got[s] - want[s]) < 1e-6 for s in got), (got, want)


def test_clm_accumulation_keeps_the_plain_mean_bit_for_bit(monkeypatch, tmp_path):
    """Equal target counts (CLM): the step's gradient is exactly that of sum(loss_m / K) and the
    logged loss exactly sum(loss_m) / K, the arithmetic of the unweighted loop."""
    k = 2
    steps = train_capturing(monkeypatch, tmp_path / "clm", grad_accum_steps=k)
    first = steps[0]
    model = build_model(read_run_config(tmp_path / "clm").model)
    model.load_state_dict(first["weights"])
    losses = []
    for batch in first["batches"]:
        loss = model(**batch).loss
        (loss / k).backward()
        losses.append(float(loss.detach()))
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, first["grads"][name]), name
    assert train_losses(tmp_path / "clm")[1] == sum(losses) / k
