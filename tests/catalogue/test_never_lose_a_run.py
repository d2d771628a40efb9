"""Never lose a run: resume is bit-identical (dropout included), SIGTERM checkpoints like Ctrl-C,
SIGKILL at random moments loses nothing (scripts/crash_test.py), and a NaN/Inf loss or gradient
skips the step or stops the run with the last good state saved."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lmlab.training.trainer as trainer
from lmlab.training.metrics import read_metrics
from lmlab.training.trainer import train
from tests.helpers import TRAIN_SET, run_cli, signal_during, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run) if "train_loss" in r}


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def optimizer_steps(run: Path, step: int) -> float:
    """AdamW's own step count in a checkpoint (optimizer steps actually taken)."""
    path = run / "checkpoints" / f"step-{step:06d}" / "optimizer.safetensors"
    tensors = load_file(str(path))
    return float(next(v for k, v in tensors.items() if k.endswith("::step")))


# ---------------------------------------------------------------------------- resume


def test_resume_with_dropout_is_bit_identical(tmp_path: Path):
    """Dropout masks come from torch's global generator, reseeded from (seed, step, micro, rank)
    before every forward, so no RNG state needs saving: 4 steps + resume to 8 equal 8 steps."""

    from lmlab.data.corpus import BUNDLED, CORPORA_DIR

    corpus = tmp_path / "corpus.txt"
    corpus.write_text((CORPORA_DIR / BUNDLED["tinyshakespeare"]).read_text()[:50_000])

    def cfg(dropout: float, max_steps: int):
        model = {"dropout": dropout, "attention": {"n_heads": 4, "dropout": dropout}}
        return tiny_config(
            model=model,
            data={"corpus": str(corpus)},
            train={"max_steps": max_steps, "lr_decay_steps": 8, "eval_every": 100},
        )

    full, part, plain = tmp_path / "full", tmp_path / "part", tmp_path / "plain"
    train(cfg(0.2, 8), out=full, progress=False)
    train(cfg(0.2, 4), out=part, progress=False)
    train(resume=part, max_steps=8, progress=False)
    train(cfg(0.0, 8), out=plain, progress=False)
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, 9))
    assert a == b  # exact float equality, step by step
    wa, wb = weights(full, 8), weights(part, 8)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert losses(plain)[2] != a[2]  # dropout was really on: without it the losses differ


# ---------------------------------------------------------------------------- SIGTERM


@pytest.mark.parametrize(
    "sig, code, what",
    [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_stop_signal_finishes_the_step_then_checkpoints(
    tmp_path: Path, capsys, monkeypatch, sig, code, what
):
    signal_during(monkeypatch, 7, sig)  # during step 5
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "run"
    got, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "20", *TRAIN_SET)
    assert got == code  # 128 + the signal number
    assert err.strip() == (
        f"{what} at step 5; checkpoint saved. Continue with: lmlab train --resume {out}"
    )
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000005"
    assert max(losses(out)) == 5  # step 5 ran to its end before the stop
    assert {s: signal.getsignal(s) for s in before} == before  # the old handlers are back
    monkeypatch.undo()
    assert run_cli(capsys, "train", "--resume", str(out), "--max-steps", "7")[0] == 0
    ref = tmp_path / "uninterrupted"  # the same schedule (decay over 20 steps), never stopped
    argv = ["train", "--out", str(ref), "--max-steps", "7", "--set", "train.lr_decay_steps=20"]
    assert run_cli(capsys, *argv, *TRAIN_SET)[0] == 0
    assert losses(out) == losses(ref)  # bit-identical, steps 1-7


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path: Path, capsys, monkeypatch):
    signal_during(monkeypatch, 7, signal.SIGINT, signal.SIGINT)  # twice during step 5
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--max-steps", "20", *TRAIN_SET]
    code, _, err = run_cli(capsys, *argv, "--set", "train.checkpoint_every=2")
    assert code == 130
    assert err.strip() == (
        f"stopped at once during step 5, without a checkpoint of it; the last good checkpoint "
        f"is {out}/checkpoints/step-000004; continue with: lmlab train --resume {out}"
    )
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"


def test_sigterm_from_another_process(tmp_path: Path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lmlab", "train", "--out", str(out), "--max-steps", "100000"]
    with open(tmp_path / "stderr", "w") as stderr:  # a file: a full pipe cannot block it
        proc = subprocess.Popen([*cmd, *TRAIN_SET], env=env, stderr=stderr)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and max(losses(out), default=0) < 3:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM) at step" in err and f"lmlab train --resume {out}" in err
    step = int(err.split("at step ")[1].split(";")[0])
    assert step >= 3
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:06d}"
    assert "Traceback" not in err


def test_stop_handlers_are_only_installed_in_the_main_thread():
    import threading

    from lmlab.training.guard import StopSignals

    sigs = (signal.SIGINT, signal.SIGTERM)
    before, seen = {s: signal.getsignal(s) for s in sigs}, []

    def worker():
        stops = StopSignals().install()  # no ValueError outside the main thread: a no-op
        seen.append({s: signal.getsignal(s) for s in sigs})
        stops.restore()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [before]
    stops = StopSignals().install()
    assert all(signal.getsignal(s) is not before[s] for s in sigs)
    stops.restore()
    assert {s: signal.getsignal(s) for s in sigs} == before


# ---------------------------------------------------------------------------- SIGKILL


def test_crash_test_script_resumes_exactly_after_three_sigkills(tmp_path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location("crash_test", ROOT / "scripts" / "crash_test.py")
    assert spec is not None and spec.loader is not None
    crash_test = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "crash_test", crash_test)  # dataclasses look it up
    spec.loader.exec_module(crash_test)
    summary = crash_test.run_crash_test(n=3, seed=7, workdir=tmp_path, log=lambda msg: None)
    assert summary["kills"] == 3 and summary["resumes"] == 3
    assert summary["resumes_reproduced"] == 3
    assert summary["trajectory_equal"] and summary["final_weights_equal"]
    assert summary["final_optimizer_equal"] and summary["ok"]
    assert all(s["checked_steps"] >= 1 for s in summary["segments"])


# ---------------------------------------------------------------------------- NaN/Inf guard

PARAM = "layers.1.ffn.down_proj.weight"


def inject(monkeypatch, at_steps, param: str = PARAM, how: str = "grad"):
    """Make ``param``'s gradient infinite (how='grad') or its weights NaN (how='weight') during
    the backward pass of the given optimizer steps (counted from 1)."""
    real_build, calls = trainer.build_model, []

    def build(cfg):
        model = real_build(cfg)
        p = dict(model.named_parameters())[param]

        def hook(grad):
            calls.append(1)
            if len(calls) not in at_steps:
                return grad
            if how == "weight":
                with torch.no_grad():
                    p.view(-1)[0] = math.nan
                return grad
            return grad * math.inf  # inf where grad != 0, nan where it is 0

        p.register_hook(hook)
        return model

    monkeypatch.setattr(trainer, "build_model", build)


def test_a_non_finite_gradient_skips_the_step_and_names_the_layer(
    tmp_path: Path, monkeypatch, capsys
):
    inject(monkeypatch, at_steps={3, 4})
    run = tmp_path / "run"
    cfg = tiny_config(train={"max_steps": 6, "max_skipped_steps": 2, "checkpoint_every": 2})
    cfg.train.keep_checkpoints = 10
    res = train(cfg, out=run, progress=False)
    assert res.step == 6
    skips = [r for r in read_metrics(run) if "skipped" in r]
    assert [r["step"] for r in skips] == [3, 4]
    assert [r["consecutive_skips"] for r in skips] == [1, 2]
    assert all(r["first_nonfinite_grad"] == PARAM for r in skips)
    assert skips[0]["skipped"].startswith("non-finite gradient (loss ")
    assert sorted(losses(run)) == [1, 2, 5, 6]  # no train_loss for the skipped steps
    err = capsys.readouterr().err
    assert "warning: step 3 skipped: non-finite gradient" in err
    assert f"first non-finite gradient: {PARAM} (1 in a row" in err
    # Skipped: the weights did not move during steps 3 and 4, and AdamW counted 4 steps, not 6.
    w2, w4, w6 = weights(run, 2), weights(run, 4), weights(run, 6)
    assert all(torch.equal(w2[k], w4[k]) for k in w2)
    assert not all(torch.equal(w4[k], w6[k]) for k in w4)
    assert optimizer_steps(run, 4) == 2 and optimizer_steps(run, 6) == 4
    assert all(bool(t.isfinite().all()) for t in w6.values())


def test_too_many_non_finite_steps_stop_with_the_last_good_state_saved(
    tmp_path: Path, monkeypatch, capsys
):
    inject(monkeypatch, at_steps=set(range(4, 100)))  # broken from step 4 on
    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--max-steps", "20", *TRAIN_SET]
    argv += ["--set", "train.max_skipped_steps=2", "--set", "train.checkpoint_every=3"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    line = [x for x in err.splitlines() if not x.startswith("warning:")]
    assert len(line) == 1 and line[0].startswith("error: training stopped at step 6: 3 steps in")
    assert f"first non-finite gradient: {PARAM}" in line[0]
    assert "more than train.max_skipped_steps=2" in line[0]
    assert f"the last good state is saved as checkpoint step-000006 in {run}/checkpoints" in err
    assert len([x for x in err.splitlines() if x.startswith("warning: step")]) == 2
    # The last good checkpoint (step 3) is intact; the new one holds the same state.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000006"
    w3, w6 = weights(run, 3), weights(run, 6)
    assert all(torch.equal(w3[k], w6[k]) for k in w3)
    assert optimizer_steps(run, 3) == optimizer_steps(run, 6) == 3
    assert [r["step"] for r in read_metrics(run) if "skipped" in r] == [4, 5, 6]


def test_non_finite_weights_are_never_checkpointed(tmp_path: Path, monkeypatch, capsys):
    # A NaN written into a weight during step 5: every later loss is NaN, and the weights are no
    # "last good state", so nothing new is saved; checkpoint step-4 stays the latest.
    inject(monkeypatch, at_steps={5}, param="final_norm.weight", how="weight")
    run = tmp_path / "run"
    cfg = tiny_config(train={"max_steps": 10, "max_skipped_steps": 1, "checkpoint_every": 4})
    with pytest.raises(trainer.LmlabError) as e:
        train(cfg, out=run, progress=False)
    assert str(e.value).startswith("training stopped at step 7: 2 steps in a row had a non-finite")
    assert "the weights are non-finite (first: final_norm.weight)" in str(e.value)
    assert f"the last good checkpoint is {run}/checkpoints/step-000004" in str(e.value)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000004"]
    from lmlab.run import load_run

    assert load_run(run, "cpu").step == 4  # the last good checkpoint still loads
