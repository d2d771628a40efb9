import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.config import TrainConfig
from lmlab.errors import CheckpointError
from lmlab.evaluation.evaluate import score_tokens
from lmlab.models import build_model
from lmlab.training import checkpoint as ck
from lmlab.training import loop
from lmlab.training import trainer as trainer_module
from lmlab.training.flops import flops_per_token, matmul_params
from lmlab.training.optim import build_optimizer, lr_at, param_groups
from tests.helpers import tiny_config, tiny_model_config


def test_lr_schedule_warms_up_linearly_then_follows_the_cosine():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == 1.0  # the peak, at the last warmup step
    assert lr_at(59, cfg) == pytest.approx(0.1 + 0.5 * 0.9)  # half way (9 -> 109): cos(pi/2) = 0
    assert lr_at(109, cfg) == 0.1  # the last step
    assert lr_at(500, cfg) == 0.1  # an extended run stays at min_lr


@pytest.mark.parametrize(
    ("max_steps", "warmup_steps", "lr_decay_steps"),
    [(20, 5, None), (100, 10, None), (7, 0, None), (3, 1, None), (50, 49, None), (40, 5, 30)],
)
def test_lr_schedule_holds_the_peak_once_and_ends_exactly_at_min_lr(
    max_steps, warmup_steps, lr_decay_steps
):
    cfg = TrainConfig(
        max_steps=max_steps,
        warmup_steps=warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr=2.0e-3,
        min_lr=1.0e-4,
    )
    lrs = [lr_at(s, cfg) for s in range(max_steps)]
    decay = lr_decay_steps or max_steps
    for s in range(warmup_steps):  # the ramp: lr * (s + 1) / W
        assert lrs[s] == pytest.approx(2.0e-3 * (s + 1) / warmup_steps, rel=1e-12)
    assert lrs.count(2.0e-3) == 1  # the peak is used by one step, not two
    peak = max(warmup_steps - 1, 0)
    assert lrs[peak] == 2.0e-3
    after = lrs[peak:decay]
    assert all(a > b for a, b in zip(after, after[1:], strict=False))  # strictly decreasing
    assert lrs[decay - 1] == 1.0e-4  # the last decay step uses exactly min_lr
    assert all(lr == 1.0e-4 for lr in lrs[decay - 1 :])


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = build_model(tiny_model_config(position={"kind": "learned"}))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attn.q_proj.weight" in decayed and "layers.0.ffn.up_proj.weight" in decayed
    assert not any(
        "norm" in n or n.endswith("bias") or "embed" in n or "position" in n for n in decayed
    )
    total = len(decay["params"]) + len(no_decay["params"])
    assert total == len(list(model.parameters()))


def _model_and_opt():
    model = build_model(tiny_model_config())
    opt = build_optimizer(model, TrainConfig())
    x = torch.randint(0, 50, (2, 8))
    model(x, targets=x).loss.backward()
    opt.step()
    return model, opt


def test_checkpoint_round_trip_restores_weights_and_optimizer_exactly(tmp_path: Path):
    model, opt = _model_and_opt()
    ck.save_checkpoint(tmp_path, 5, model, opt, {"step": 5, "tokens": 80})
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step-000005"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000005"
    model2 = build_model(tiny_model_config())
    opt2 = build_optimizer(model2, TrainConfig())
    ck.load_model_weights(latest, model2)
    ck.load_optimizer(latest, opt2, model2)
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2), n
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][key], s2[k][key])
    assert ck.read_trainer_state(latest) == {"step": 5, "tokens": 80}


def test_only_the_newest_checkpoints_are_kept_and_temp_folders_are_ignored(tmp_path: Path):
    model, opt = _model_and_opt()
    # A crash mid-write leaves a temporary folder; it is never taken for a checkpoint.
    (tmp_path / "checkpoints" / ".tmp-step-000009-1").mkdir(parents=True)
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(tmp_path, step, model, opt, {"step": step, "tokens": 0}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000003", "step-000004"]


def test_corrupt_or_missing_checkpoints_are_reported(tmp_path: Path):
    with pytest.raises(CheckpointError, match="has no checkpoint yet"):
        ck.latest_checkpoint(tmp_path)
    model, opt = _model_and_opt()
    ckpt = ck.save_checkpoint(tmp_path, 1, model, opt, {"step": 1, "tokens": 0})
    data = (ckpt / ck.MODEL_FILE).read_bytes()
    (ckpt / ck.MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="is corrupt"):
        ck.load_model_weights(ckpt, build_model(tiny_model_config()))
    (ckpt / ck.STATE_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="trainer_state.json is not valid JSON"):
        ck.read_trainer_state(ckpt)
    with pytest.raises(CheckpointError, match="has no tensor layers.2.*was model.n_layers"):
        other = ck.save_checkpoint(tmp_path, 2, model, opt, {"step": 2, "tokens": 0})
        ck.load_model_weights(other, build_model(tiny_model_config(n_layers=3)))


def test_flops_per_token_matches_a_hand_count():
    cfg = tiny_model_config(vocab_size=50)  # d=32, 2 layers, 4 heads, d_ff=128, tied head
    model = build_model(cfg)
    per_layer = 4 * 32 * 32 + 2 * 32 * 128
    assert matmul_params(model) == 2 * per_layer + 50 * 32
    fwd = 2 * (2 * per_layer + 50 * 32) + 4 * 2 * 16 * 32
    assert flops_per_token(model, cfg, 16, train=False) == fwd
    assert flops_per_token(model, cfg, 16) == 3 * fwd


@pytest.mark.parametrize("stride", [None, 4, 7])
def test_windowed_scoring_scores_every_token_once_and_matches_one_pass(stride):
    cfg = tiny_model_config(vocab_size=20, max_seq_len=64, position={"kind": "none"})
    model = build_model(cfg).eval()
    ids = np.random.default_rng(0).integers(0, 20, size=40)
    nbytes = np.ones(20, dtype=np.int64)
    res = score_tokens(model, ids, nbytes, max_seq_len=64, stride=stride)
    x = torch.from_numpy(ids).long()[None]
    with torch.no_grad():
        ref = float(model(x[:, :-1], targets=x[:, 1:]).loss)  # one pass: the whole text fits
    assert res.tokens == 39 and res.bytes == 39
    assert res.loss == pytest.approx(ref, abs=1e-5)
    assert res.perplexity == pytest.approx(math.exp(ref), rel=1e-5)
    assert res.bits_per_byte == pytest.approx(ref / math.log(2), rel=1e-5)
    short = score_tokens(model, ids, nbytes, max_seq_len=8, stride=stride if stride != 7 else 3)
    assert short.tokens == 39  # windows of 8: still every target exactly once


def test_metrics_records_are_json_lines(tmp_path: Path):
    from lmlab.training.metrics import MetricsLogger, plot_losses, read_metrics, truncate_metrics

    log = MetricsLogger(tmp_path, tensorboard=False)
    for s in (1, 2, 3):
        log.log({"step": s, "tokens": s * 10, "elapsed_s": s, "train_loss": 3.0 - s * 0.1})
    log.log({"step": 3, "tokens": 30, "elapsed_s": 3.5, "val_loss": float("nan")})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "tok')  # a torn line from a crash
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 3]
    assert read_metrics(tmp_path)[3]["val_loss"] is None  # non-finite: written as null
    truncate_metrics(tmp_path, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()] == [1, 2]
    png = plot_losses(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_peak_keeps_the_best_good_measurement(tmp_path: Path, monkeypatch):
    from lmlab.training import hardware

    monkeypatch.setenv("LMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "_cpu_busy", lambda device: None)  # a quiet machine
    reading = {"flops": 5.0e10}
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, prec: reading["flops"])
    cpu = torch.device("cpu")
    assert hardware.matmul_peak(cpu, "bf16").flops == 5.0e10
    reading["flops"] = 2.0e10  # below 70% of the recorded best: something slowed it
    peak = hardware.matmul_peak(cpu, "bf16")
    assert peak.flops == 5.0e10 and "not used" in peak.source and "recorded" in peak.source
    reading["flops"] = 9.0e10
    assert hardware.matmul_peak(cpu, "bf16").flops == 9.0e10
    reading["flops"] = 8.0e10  # a fair reading, not the best: the best stays
    assert hardware.matmul_peak(cpu, "bf16").flops == 9.0e10
    assert hardware.matmul_peak(cpu, "fp32").flops == 8.0e10  # keyed by precision: a fresh entry
    (tmp_path / "matmul_peak.json").write_text("garbage")
    assert hardware.matmul_peak(cpu, "bf16").flops == 8.0e10  # an unreadable cache: measure


def test_matmul_peak_measured_under_load_is_never_the_denominator(tmp_path: Path, monkeypatch):
    from lmlab.training import hardware

    monkeypatch.setenv("LMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, prec: 1.0e10)
    monkeypatch.setattr(hardware, "_cpu_busy", lambda device: 7.5)  # load average 7.5
    cpu = torch.device("cpu")
    peak = hardware.matmul_peak(cpu, "fp32")  # busy, nothing recorded: no peak, no MFU
    assert peak.flops is None and "busy" in peak.source and "not reported" in peak.source
    assert not (tmp_path / "matmul_peak.json").exists()  # nor is it recorded
    (tmp_path / "matmul_peak.json").write_text(json.dumps({"x": "bad", "y": -1.0}))
    monkeypatch.setattr(hardware, "_cpu_busy", lambda device: None)
    assert hardware.matmul_peak(cpu, "fp32").flops == 1.0e10  # quiet now: measured, recorded
    monkeypatch.setattr(hardware, "_cpu_busy", lambda device: 7.5)
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, prec: 3.0e10)
    peak = hardware.matmul_peak(cpu, "fp32")  # even a higher busy reading is not recorded
    assert peak.flops == 1.0e10 and "busy" in peak.source


def test_mfu_is_at_most_1_and_the_log_names_the_peak(tmp_path: Path, monkeypatch, capsys):
    from lmlab.training import hardware

    tiny = hardware.MatmulPeak(1.0, "1 FLOP/s, a test's peak")  # far below any real rate
    monkeypatch.setattr(loop, "matmul_peak", lambda device, precision: tiny)
    cfg = tiny_config(train={"max_steps": 2})
    res = trainer_module.train(cfg, out=tmp_path / "run", progress=None)
    assert "MFU denominator (matmul peak): 1 FLOP/s, a test's peak" in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "mfu" in r]
    assert all(r["mfu"] == 1.0 for r in steps) and res.mfu == 1.0
    assert steps[0]["mfu_peak_flops"] == 1.0 and steps[0]["mfu_peak_source"] == tiny.source
    assert "mfu_peak_source" not in steps[1]


def test_measured_matmul_peak_is_a_plausible_rate():
    from lmlab.training.hardware import measure_matmul_peak

    rate = measure_matmul_peak(torch.device("cpu"), "fp32", seconds=0.05)
    assert 1e9 < rate < 1e14  # FLOP/s: between 1 GFLOP/s and 100 TFLOP/s


def _train_on_a_pty(tmp_path: Path, monkeypatch) -> str:
    """Train 20 steps (validation every 5) with stderr on a fresh pseudo-terminal, which reports
    0 columns as some CI terminals do; returns what the terminal showed."""
    import io
    import os
    import pty
    import sys
    import threading

    from lmlab.training.trainer import train
    from tests.helpers import tiny_config

    master, slave = pty.openpty()  # a new pty: 0 rows, 0 columns
    assert os.get_terminal_size(slave).columns == 0
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    tty = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), encoding="utf-8")
    monkeypatch.setattr(sys, "stderr", tty)
    cfg = tiny_config(train={"max_steps": 20, "eval_every": 5})
    train(cfg, out=tmp_path / "run", progress=None)  # progress=None: a bar when on a terminal
    tty.flush()
    tty.close()
    reader.join(timeout=5)
    os.close(master)
    return b"".join(chunks).decode("utf-8", errors="replace")


def test_the_progress_bar_shows_validation_even_on_a_zero_column_terminal(tmp_path, monkeypatch):
    shown = _train_on_a_pty(tmp_path, monkeypatch)
    assert "| 20/20 [" in shown  # the bar is drawn, at a sane width
    assert "val_loss=" in shown  # the bar carries the latest validation loss
    for step in (5, 10, 15):  # and each periodic validation line is printed above it
        assert f"step {step}/20  val_loss " in shown, shown[-2000:]


def test_a_gradient_norm_past_float32_range_skips_the_step(tmp_path: Path, monkeypatch):
    # every gradient finite, their global norm inf in float32 (torch's and the clip kernel's):
    # clip_gradients names no parameter and scales nothing, so the step must be skipped on the
    # norm itself (it was taken, with gradients of 1e38)
    from lmlab.training.metrics import read_metrics

    param, calls = "layers.1.ffn.down_proj.weight", []
    real_build = trainer_module.build_model

    def build(cfg):
        model = real_build(cfg)
        p = dict(model.named_parameters())[param]
        p.register_hook(
            lambda g: calls.append(1) or (torch.full_like(g, 1e38) if len(calls) == 2 else g)
        )
        return model

    monkeypatch.setattr(trainer_module, "build_model", build)
    cfg = tiny_config(train={"max_steps": 3, "max_skipped_steps": 2})
    res = trainer_module.train(cfg, out=tmp_path / "run", progress=False)
    assert res.step == 3
    skips = [r for r in read_metrics(tmp_path / "run") if "skipped" in r]
    assert [r["step"] for r in skips] == [2]
    assert skips[0]["skipped"].startswith("non-finite gradient (loss ")
