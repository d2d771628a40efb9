"""lmlab compare: variants x seeds train into one folder, report.md + plots, and a re-run
continues where the comparison stopped without re-training finished runs."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmlab.cli import main
from lmlab.errors import Interrupted, LmlabError
from lmlab.experiments import compare as compare_mod
from lmlab.experiments.compare import compare, run_dir, train_tokens_per_s
from lmlab.experiments.report import seed_noise_verdict
from lmlab.experiments.spec import experiment_from_dict
from lmlab.training import trainer
from lmlab.training.checkpoint import latest_checkpoint, read_trainer_state
from lmlab.training.metrics import read_metrics
from tests.helpers import TINY

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_experiment(**fields: Any) -> dict[str, Any]:
    """Two variants of the tiny config that differ in KV-cache size: MHA and MQA."""
    base = copy.deepcopy(TINY)
    base.pop("name")
    exp = {
        "name": "tinycmp",
        "claim": "MQA keeps quality at a quarter of the KV cache",
        "base": base,
        "variants": {"mha": {}, "mqa": {"model.attention.n_kv_heads": 1}},
        "seeds": [1, 2],
        "budget": {"steps": 2},
    }
    exp.update(fields)
    return exp


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def table_rows(report: str) -> dict[str, str]:
    """The comparison table's rows (the first table of report.md), keyed by the variant cell."""
    table = report.split("\n\n| variant |", 1)[1].split("\n\n", 1)[0]
    return {r.split("|")[1].strip(): r for r in table.splitlines() if r.startswith("| `")}


class TrainCounter:
    """Wraps trainer.train: counts calls; optionally raises Interrupted in call ``stop_at``
    after training that run to ``stop_step`` (a comparison stopped mid-run)."""

    def __init__(self, stop_at: int | None = None, stop_step: int = 1) -> None:
        self.calls: list[Path] = []
        self.stop_at, self.stop_step = stop_at, stop_step
        self.real = trainer.train

    def __call__(self, cfg, out=None, resume=None, max_steps=None, **kw):
        self.calls.append(Path(out or resume))
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            self.real(cfg, out=out, resume=resume, max_steps=self.stop_step, **kw)
            raise Interrupted("interrupted at step 1; checkpoint saved", 130)
        return self.real(cfg, out=out, resume=resume, max_steps=max_steps, **kw)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """One uninterrupted 2-variant x 2-seed x 2-step comparison (shared; do not modify)."""
    root = tmp_path_factory.mktemp("compare")
    spec = write_yaml(root / "tinycmp.yaml", tiny_experiment())
    out = root / "out"
    res = compare(spec, out=out, log=lambda m: None)
    return spec, out, res


def test_comparison_writes_the_table_and_the_plots(finished):
    spec, out, res = finished
    assert res.trained == [("mha", 1), ("mha", 2), ("mqa", 1), ("mqa", 2)]
    report = (out / "report.md").read_text(encoding="utf-8")
    rows = table_rows(report)
    assert {"`mha`", "`mqa`"} <= set(rows)
    by = {(s["variant"], s["seed"]): s for s in res.summaries}
    # the table's mean +/- sample std is over the two seeds' final val losses
    losses = [by[("mqa", s)]["val_loss"] for s in (1, 2)]
    mean, std = sum(losses) / 2, abs(losses[0] - losses[1]) / math.sqrt(2)
    assert f"{mean:.4f} ± {std:.4f}" in rows["`mqa`"]
    assert f"{math.exp(mean):.2f}" in rows["`mqa`"]
    # KV cache: 2 (K, V) x 2 layers x kv heads x head_dim 8 x 4 bytes; MQA has 1 kv head of 4
    assert by[("mha", 1)]["kv_cache_bytes_per_token"] == 2 * 2 * 4 * 8 * 4 == 512
    assert by[("mqa", 1)]["kv_cache_bytes_per_token"] == 2 * 2 * 1 * 8 * 4 == 128
    assert "| 512 |" in rows["`mha`"] and "| 128 |" in rows["`mqa`"]
    assert by[("mqa", 1)]["params"] < by[("mha", 1)]["params"]  # smaller k/v projections
    assert all(s["decode_tokens_per_s"] > 0 and s["tokens_per_s"] > 0 for s in res.summaries)
    assert all(s["step"] == 2 for s in res.summaries)
    assert "`mqa` vs `mha`: val loss" in report
    for name in ("val_loss_vs_step.png", "val_loss_vs_time.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
        assert f"]({name})" in report


def test_rerun_trains_nothing_and_leaves_checkpoints_alone(finished, monkeypatch):
    spec, out, first = finished
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("model.safetensors")}
    assert len(mtimes) == 4
    counter = TrainCounter()
    monkeypatch.setattr(compare_mod.trainer, "train", counter)
    res = compare(spec, out=out, log=lambda m: None)
    assert counter.calls == [] and res.trained == [] and res.measured == []
    assert len(res.skipped) == 4
    assert {p: p.stat().st_mtime_ns for p in out.rglob("model.safetensors")} == mtimes


def test_stopped_comparison_resumes_where_it_stopped(finished, tmp_path, monkeypatch):
    _, _, full = finished
    spec = write_yaml(tmp_path / "tinycmp.yaml", tiny_experiment(seeds=[1]))
    out = tmp_path / "out"
    stopper = TrainCounter(stop_at=2)  # the 2nd run (mqa seed 1) stops after step 1 of 2
    monkeypatch.setattr(compare_mod.trainer, "train", stopper)
    with pytest.raises(Interrupted, match="continue it with: lmlab compare .* --out"):
        compare(spec, out=out, log=lambda m: None)
    stopped = run_dir(out, "mqa", 1)
    assert read_trainer_state(latest_checkpoint(stopped))["step"] == 1
    assert not (stopped / "summary.json").exists()
    first_ckpt = (run_dir(out, "mha", 1) / "checkpoints").stat().st_mtime_ns

    counter = TrainCounter()
    monkeypatch.setattr(compare_mod.trainer, "train", counter)
    lines: list[str] = []
    res = compare(spec, out=out, log=lines.append)
    assert res.skipped == [("mha", 1)]  # finished before the stop: not re-run
    assert counter.calls == [stopped]
    assert any("mqa seed 1: resuming from step 1" in line for line in lines)
    assert (run_dir(out, "mha", 1) / "checkpoints").stat().st_mtime_ns == first_ckpt
    # the resumed run retraces the uninterrupted one exactly
    full_val = {(s["variant"], s["seed"]): s["val_loss"] for s in full.summaries}
    for s in res.summaries:
        assert s["val_loss"] == full_val[(s["variant"], s["seed"])]
    steps = [r["step"] for r in read_metrics(stopped) if "train_loss" in r]
    assert steps == [1, 2]


def test_time_budget_counts_training_time_over_sessions(tmp_path, monkeypatch):
    exp = tiny_experiment(variants={"mha": {}}, seeds=[1], budget={"time_s": 1.0})
    exp["base"]["train"]["max_steps"] = 100_000  # the cap and the schedule length
    spec = write_yaml(tmp_path / "t.yaml", exp)
    res = compare(spec, out=tmp_path / "out", log=lambda m: None)
    state = read_trainer_state(latest_checkpoint(run_dir(tmp_path / "out", "mha", 1)))
    # stopped by the clock (the step-0 eval counts too), long before the step cap
    assert state["elapsed_s"] >= 1.0 and state["step"] < 100_000
    assert res.summaries[0]["step"] == state["step"]
    counter = TrainCounter()
    monkeypatch.setattr(compare_mod.trainer, "train", counter)
    compare(spec, out=tmp_path / "out", log=lambda m: None)
    assert counter.calls == []  # the budget is used up: finished


def test_budget_reached_rule():
    from lmlab.experiments.spec import Budget

    steps, clock = Budget("steps", 10), Budget("time_s", 5.0)
    assert compare_mod.budget_reached({"step": 10, "elapsed_s": 0.1}, 10, steps)
    assert not compare_mod.budget_reached({"step": 9, "elapsed_s": 99.0}, 10, steps)
    assert compare_mod.budget_reached({"step": 3, "elapsed_s": 5.0}, 10, clock)
    assert not compare_mod.budget_reached({"step": 3, "elapsed_s": 4.9}, 10, clock)


def test_tokens_budget_gives_each_variant_the_same_tokens():
    exp = experiment_from_dict(
        tiny_experiment(variants={"b4": {}, "b8": {"train.batch_size": 8}}, budget={"tokens": 4096})
    )
    # 4 x 32 = 128 tokens per step -> 32 steps; 8 x 32 = 256 -> 16 steps
    assert exp.config("b4", 1).train.max_steps == 32
    assert exp.config("b8", 1).train.max_steps == 16


def test_diverged_run_is_reported_and_not_retried(tmp_path, monkeypatch):
    real = trainer.train

    def diverging(cfg, out=None, resume=None, max_steps=None, **kw):
        real(cfg, out=out, resume=resume, max_steps=1, **kw)
        raise LmlabError("training stopped at step 1: 4 steps in a row had a non-finite loss")

    spec = write_yaml(tmp_path / "d.yaml", tiny_experiment(seeds=[1], variants={"mha": {}}))
    monkeypatch.setattr(compare_mod.trainer, "train", diverging)
    compare(spec, out=tmp_path / "out", log=lambda m: None)
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "diverged (1/1 seeds)" in report and "non-finite loss" in report
    counter = TrainCounter()
    monkeypatch.setattr(compare_mod.trainer, "train", counter)
    compare(spec, out=tmp_path / "out", log=lambda m: None)
    assert counter.calls == []


def test_seed_noise_verdicts():
    assert seed_noise_verdict([1.00, 1.02], [1.01, 1.03]) == "within seed noise"  # overlap
    assert seed_noise_verdict([1.00, 1.01], [1.50, 1.51]) == "exceeds seed noise"
    # separated, but a gap of 0.02 < 2 x the larger std (0.01 * sqrt 2)
    assert seed_noise_verdict([1.00, 1.02], [1.021, 1.041]) == "suggestive"
    assert seed_noise_verdict([1.0], [2.0]) == "one seed"


def test_train_tokens_per_s_weights_windows_by_tokens():
    records = [
        {"step": 0, "tokens": 0, "val_loss": 4.0},
        {"step": 10, "tokens": 1000, "tokens_per_s": 100.0},  # 10 s
        {"step": 20, "tokens": 2000, "tokens_per_s": 1000.0},  # 1 s
    ]
    assert train_tokens_per_s(records) == pytest.approx(2000 / 11)


def test_compare_cli_prints_the_report(tmp_path, capsys):
    spec = write_yaml(tmp_path / "c.yaml", tiny_experiment(seeds=[3], variants={"only": {}}))
    code = main(["compare", str(spec), "--out", str(tmp_path / "o"), "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("# tinycmp") and "| `only` |" in out
    assert "[1/1] only seed 3" in err


def test_plots_draw_measured_points_not_an_interpolated_end(tmp_path):
    """Two seeds measured at the same steps, one twice as slow: against wall time each seed's
    own points are drawn (the slow seed's last loss included), the band only where both have
    data; against steps, the mean at the shared steps."""
    from lmlab.experiments.report import plot_curves

    fast = [[0, 0.0, 4.0], [10, 1.0, 3.0], [20, 2.0, 2.5], [30, 3.0, 2.2]]
    slow = [[0, 0.0, 4.2], [10, 2.0, 3.1], [20, 4.0, 2.6], [30, 6.0, 2.0]]
    groups = {"mha": [{"val_curve": fast}, {"val_curve": slow}]}
    path, (series,) = plot_curves(groups, tmp_path / "time.png", "time", "t")
    assert path.is_file() and series.n_runs == 2
    measured = {(t, loss) for curve in (fast, slow) for _, t, loss in curve}
    drawn = {(x, y) for xs, ys in series.lines for x, y in zip(xs, ys, strict=True)}
    assert drawn == measured  # every measured point, nothing interpolated
    assert max(xs[-1] for xs, _ in series.lines) == 6.0  # the slow seed's end is drawn
    assert series.band is not None and max(series.band[0]) == 3.0  # both seeds ran to 3 s
    _, (by_step,) = plot_curves(groups, tmp_path / "step.png", "step", "s")
    ((steps, means),) = by_step.lines
    assert steps == [0.0, 10.0, 20.0, 30.0] and means == pytest.approx([4.1, 3.05, 2.55, 2.1])
    assert by_step.band is not None and by_step.band[1][-1] == 2.0 and by_step.band[2][-1] == 2.2
