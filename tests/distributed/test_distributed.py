"""Distributed training on 2 CPU processes (gloo) equals one process with the same global batch.

One torchrun job (module fixture ``two_ranks``) trains DDP and FSDP2 runs with 2 micro-batches
per rank (so DDP's no_sync / FSDP2's deferred reduce-scatter are on the path) and resumes a
one-process FSDP run with 2 ranks. The references are one process with the same global batch:
``ref4`` (grad_accum_steps=4 = 2 ranks x 2) and ``ref2`` (2 = 2 ranks x 1). Tolerance 1e-6
(float32, AdamW, dropout 0): the ranks run 1 thread each, the references 2, so matmul sums differ
in their last bits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lmlab
from lmlab.config import ConfigError, RunConfig
from lmlab.data.dataset import batch_rng, sample_batch
from lmlab.errors import LmlabError
from lmlab.run import load_run
from lmlab.training.distributed import Parallel, launch
from lmlab.training.trainer import train
from tests.distributed._uneven import patch_uneven_clm
from tests.helpers import tiny_config

WORKER = Path(__file__).with_name("_worker.py")
TOL = 1e-6
STEPS = 3


def config(**train_fields: object) -> RunConfig:
    fields = {"max_steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 5, **train_fields}
    return tiny_config(train=fields)


def child_env() -> dict[str, str]:
    src = str(Path(lmlab.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_command(cmd: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """Run a launcher in its own session; on timeout kill the whole group (no stray ranks)."""
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:4]} timed out; stderr tail:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_clean_exit(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == 0, res.stderr[-4000:]
    assert "terminate called" not in res.stderr
    assert "Traceback" not in res.stderr


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def metrics(run: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def assert_same_trajectory(run: Path, ref: Path, steps: range) -> None:
    for step in steps:
        assert max_diff(weights(run, step), weights(ref, step)) < TOL, f"step {step}"
    got, want = metrics(run, "train_loss"), metrics(ref, "train_loss")
    for step in steps:
        assert abs(got[step] - want[step]) < TOL


def state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").read_text())


def _reference(tmp_path_factory: pytest.TempPathFactory, accum: int) -> Path:
    out = tmp_path_factory.mktemp("dist") / f"ref{accum}"
    train(config(grad_accum_steps=accum), out=out, progress=False)
    # the trajectory moves: equal weights below are not equal because nothing trained
    assert max_diff(weights(out, 1), weights(out, STEPS)) > 1e-3
    return out


@pytest.fixture(scope="module")
def ref2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, grad_accum_steps=2: the global batch of 2 ranks x 1 micro-batch."""
    return _reference(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def ref4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, grad_accum_steps=4: the global batch of 2 ranks x 2 micro-batches."""
    return _reference(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One torchrun job of 2 ranks x 2 micro-batches: DDP 3 steps, FSDP2 2 steps; a
    1-process FSDP run (2 steps, grad_accum 2) resumed with 2 ranks to step 3; DDP with Muon;
    and last (its patch stays installed) DDP 2 ranks x 1 micro-batch of unequal target counts
    (one torchrun start and 2 rank imports for all of them)."""
    base = tmp_path_factory.mktemp("dist")
    names = ("ddp2", "fsdp2", "fsdp1to2", "ddp2muon", "ddp_uneven")
    runs = {name: base / name for name in names}
    train(config(grad_accum_steps=2, parallel="fsdp"), out=runs["fsdp1to2"], max_steps=2)
    jobs = [
        {"config": config(grad_accum_steps=2).to_dict(), "out": str(runs["ddp2"])},
        {
            "config": config(grad_accum_steps=2, parallel="fsdp").to_dict(),
            "out": str(runs["fsdp2"]),
            "max_steps": 2,
        },
        {"resume": str(runs["fsdp1to2"]), "max_steps": STEPS},
        {"config": config(grad_accum_steps=1, **MUON).to_dict(), "out": str(runs["ddp2muon"])},
        {"config": config(batch_size=2).to_dict(), "out": str(runs["ddp_uneven"]),
         "uneven_targets": True},
    ]  # fmt: skip
    (base / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = run_command([*cmd, str(WORKER), str(base / "jobs.json")])
    assert_clean_exit(res)
    return runs


def test_ddp_two_ranks_equal_one_process_with_accumulation(ref4, two_ranks):
    run = two_ranks["ddp2"]
    assert_same_trajectory(run, ref4, range(1, STEPS + 1))
    got, want = metrics(run, "val_loss"), metrics(ref4, "val_loss")  # eval split by rank
    assert got.keys() == want.keys() == {0, STEPS}
    assert all(abs(got[s] - want[s]) < TOL for s in got)
    assert metrics(run, "tokens") == metrics(ref4, "tokens")  # global tokens per step
    assert state(run, STEPS)["world_size"] == 2
    # optimizer moments too (rank 0 writes the whole AdamW state)
    opt = "checkpoints/step-000003/optimizer.safetensors"
    assert max_diff(load_file(str(run / opt)), load_file(str(ref4 / opt))) < TOL


MUON = {"optimizer": "muon", "schedule": "wsd"}


def test_ddp_two_ranks_with_muon_follow_one_process(two_ranks, tmp_path, one_thread):
    """train.optimizer: muon under DDP (2 ranks x 1 micro-batch) follows one process with
    grad_accum_steps=2, to 1e-4. The one process runs on one thread, as each rank does: Muon's
    Newton-Schulz runs in bfloat16, where the last-bit gradient differences of 1 vs 2 threads
    (torch's threaded column sums, oneDNN's products) round apart: 1.6e-4 measured on the Zen 4
    with the reference on 2 threads, at the commit before and after the bias + GELU operator."""
    ref = tmp_path / "ref"
    train(config(grad_accum_steps=2, **MUON), out=ref, progress=False)
    assert max_diff(weights(ref, 1), weights(ref, STEPS)) > 1e-3  # the weights move
    for step in range(1, STEPS + 1):
        assert max_diff(weights(two_ranks["ddp2muon"], step), weights(ref, step)) < 1e-4


def test_fsdp2_two_ranks_equal_one_process_with_accumulation(ref4, two_ranks):
    run = two_ranks["fsdp2"]
    assert_same_trajectory(run, ref4, range(1, 3))  # gathered model.safetensors
    ckpt = run / "checkpoints" / "step-000002"
    # the one checkpoint format: the shards gathered to rank 0, no DCP pickle, no manifest
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    opt = "checkpoints/step-000002/optimizer.safetensors"  # both ranks' AdamW shards, whole
    assert max_diff(load_file(str(run / opt)), load_file(str(ref4 / opt))) < TOL
    loaded = load_run(run, "cpu")  # lmlab eval / generate read the gathered weights
    assert loaded.step == 2
    got = {k: v for k, v in loaded.model.state_dict().items() if k in weights(ref4, 2)}
    assert max_diff(got, weights(ref4, 2)) < TOL


def test_fsdp_resume_one_to_two_ranks_continues_the_trajectory(ref2, two_ranks):
    run = two_ranks["fsdp1to2"]
    assert state(run, 2)["world_size"] == 1 and state(run, STEPS)["world_size"] == 2
    assert state(run, STEPS)["grad_accum_steps"] == 1  # 2 ranks x 1 = the saved 1 x 2
    assert_same_trajectory(run, ref2, range(1, STEPS + 1))


def test_fsdp_resume_two_ranks_to_one_continues_the_trajectory(ref4, two_ranks, tmp_path):
    run = tmp_path / "fsdp2to1"
    shutil.copytree(two_ranks["fsdp2"], run)
    res = train(resume=run, max_steps=STEPS, progress=False)  # one plain process reads it
    assert res.step == STEPS
    assert state(run, STEPS)["world_size"] == 1 and state(run, STEPS)["grad_accum_steps"] == 4
    assert_same_trajectory(run, ref4, range(1, STEPS + 1))


def test_ddp_resume_two_ranks_to_one_continues_the_trajectory(ref4, two_ranks, tmp_path):
    run = tmp_path / "ddp2to1"
    shutil.copytree(two_ranks["ddp2"], run)
    shutil.rmtree(run / "checkpoints" / "step-000003")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    train(resume=run, max_steps=STEPS, progress=False)
    assert state(run, STEPS)["world_size"] == 1
    assert_same_trajectory(run, ref4, range(1, STEPS + 1))


def test_ddp_weights_ranks_by_their_target_tokens(two_ranks, tmp_path, monkeypatch):
    """2 ranks x 1 micro-batch whose rows hold unequal numbers of targets follow one process
    training on one batch holding both ranks' rows: the loss and the gradient are the mean over
    every target, not the mean of the ranks' means."""
    ddp = two_ranks["ddp_uneven"]
    with monkeypatch.context() as m:
        patch_uneven_clm(m.setattr, parts=2)
        train(config(batch_size=4), out=tmp_path / "one", progress=False)
    for key in ("train_loss", "grad_norm"):  # grad_norm: before clipping
        got, want = metrics(ddp, key), metrics(tmp_path / "one", key)
        assert all(abs(got[s] - want[s]) < TOL for s in range(1, STEPS + 1)), (key, got, want)
    # AdamW's first step moves each weight by lr * g / (|g| + 1e-8): entries with |g| near 1e-8
    # turn the float32 rounding of a different summation order into ~4e-6
    for step in range(1, STEPS + 1):
        assert max_diff(weights(ddp, step), weights(tmp_path / "one", step)) < 1e-5


def test_cli_nproc_resumes_a_one_process_ddp_run_with_two_ranks(ref2, tmp_path):
    """``lmlab train --nproc 2`` (torchrun, env:// process group owned by train()): the
    run continues the trajectory, rank 0 alone reports, and both ranks exit cleanly."""
    run = tmp_path / "ddp1to2"
    train(config(grad_accum_steps=2), out=run, max_steps=2, progress=False)
    cmd = [sys.executable, "-m", "lmlab", "train", "--nproc", "2", "--resume", str(run)]
    res = run_command([*cmd, "--max-steps", str(STEPS), "--no-progress"])
    assert_clean_exit(res)
    assert res.stderr.count("trained ") == 1, res.stderr
    assert res.stderr.count("grad_accum_steps 2 -> 1 keeps its global batch") == 1
    assert state(run, STEPS)["world_size"] == 2
    assert_same_trajectory(run, ref2, range(1, STEPS + 1))


# ---------------------------------------------------------------- FSDP mode in one process


def test_fsdp_mode_in_one_process_writes_and_resumes_the_usual_checkpoint(tmp_path):
    """No process group: nothing is sharded, the checkpoint is the usual one and resumes."""
    run = tmp_path / "fsdp1"
    train(config(parallel="fsdp", max_steps=1), out=run, progress=False)
    ckpt = run / "checkpoints" / "step-000001"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    assert train(resume=run, max_steps=2, progress=False).step == 2


# ---------------------------------------------------------------- data split and small units


def test_ranks_draw_disjoint_windows_that_make_up_the_one_process_batch():
    tokens = np.arange(100_000, dtype=np.uint16) % 50_000  # rows identify their start
    accum, world = 2, 2
    for step in range(5):
        per_rank = []
        for rank in range(world):
            par = Parallel(rank=rank, world_size=world)
            rows = [
                tuple(r)
                for m in range(accum)
                for r in sample_batch(tokens, 4, 8, batch_rng(1, step, par.micro_index(m, accum)))[
                    0
                ].tolist()
            ]
            per_rank.append(rows)
        assert not set(per_rank[0]) & set(per_rank[1])
        one = [
            tuple(r)
            for g in range(world * accum)
            for r in sample_batch(tokens, 4, 8, batch_rng(1, step, g))[0].tolist()
        ]
        assert sorted(per_rank[0] + per_rank[1]) == sorted(one)


def test_a_non_finite_loss_is_checkpointed_as_null_so_the_run_stays_resumable(tmp_path):
    from lmlab.models.build import build_model
    from lmlab.training.checkpoint import latest_checkpoint, read_trainer_state
    from lmlab.training.optim import build_optimizer

    cfg = config()
    cfg.model.vocab_size = 50
    model = build_model(cfg.model)
    state = {"step": 1, "tokens": 8, "val_loss": float("inf"), "train_loss": 2.5}
    Parallel().save_checkpoint(
        tmp_path, 1, model, build_optimizer(model, cfg.train), state, 2, cfg.model
    )
    read = read_trainer_state(latest_checkpoint(tmp_path))  # strict JSON: Infinity is refused
    assert read["val_loss"] is None and read["train_loss"] == 2.5


def test_parallel_config_is_validated():
    with pytest.raises(ConfigError, match="train.parallel: 'zero' is not allowed"):
        tiny_config(train={"parallel": "zero"})


def test_half_set_torchrun_environment_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LmlabError, match="not WORLD_SIZE, LOCAL_RANK"):
        Parallel.from_env()
    with pytest.raises(LmlabError, match="--nproc starts torchrun itself"):
        launch(2, ["train"])


def test_resume_keeps_the_global_batch_or_refuses():
    saved = {"world_size": 2, "grad_accum_steps": 3}  # 6 micro-batches per step
    assert Parallel(rank=1, world_size=1).resume_grad_accum(saved, 3) == 6
    assert Parallel(rank=1, world_size=6).resume_grad_accum(saved, 3) == 1
    with pytest.raises(LmlabError, match="cannot share them evenly"):
        Parallel(world_size=4).resume_grad_accum(saved, 3)


class _FakeDDP:
    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.entered += 1
        yield


class _FakeFSDP:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.calls.append(sync)


def test_gradients_sync_only_on_the_last_micro_batch():
    ddp, fsdp = _FakeDDP(), _FakeFSDP()
    accum = 3
    par = Parallel(rank=0, world_size=2, _ddp=ddp)  # type: ignore[arg-type]
    for micro in range(accum):
        with par.sync_gradients(micro == accum - 1):
            pass
    assert ddp.entered == accum - 1  # no_sync on all but the last
    par = Parallel(rank=0, world_size=2, _fsdp=fsdp)  # type: ignore[arg-type]
    for micro in range(accum):
        with par.sync_gradients(micro == accum - 1):
            pass
    assert fsdp.calls == [False, False, True]


def test_nproc_is_removed_from_the_command_each_rank_runs():
    from lmlab.cli import _without_nproc

    argv = ["train", "--nproc", "2", "--out", "r", "--nproc=4", "--set", "a=1", "--npr", "3"]
    assert _without_nproc(argv) == ["train", "--out", "r", "--set", "a=1"]
    assert _without_nproc(["train", "--no-progress"]) == ["train", "--no-progress"]
