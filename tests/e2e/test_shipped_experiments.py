"""Every experiment in experiments/ parses, and its --smoke version (2 steps per variant, one
seed, tiny eval) trains every variant and writes the report: what CI runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.experiments.compare import compare
from lmlab.experiments.spec import load_experiment
from lmlab.training import hardware, loop

EXPERIMENTS = sorted((Path(__file__).parents[2] / "experiments").glob("*.yaml"))


def test_one_experiment_per_claim():
    assert len(EXPERIMENTS) == 12
    for path in EXPERIMENTS:
        exp = load_experiment(path)
        assert len(exp.seeds) >= 2, f"{path.name}: needs >= 2 seeds to judge seed noise"
        assert exp.claim, f"{path.name}: states no claim"
        assert "Time on a quiet 2-core CPU" in path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_smoke(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(loop, "plot_losses", lambda run_dir: None)  # per-run loss.png: slow
    # Each run measures the matmul peak (seconds in bf16 on a CPU without bf16 units): not
    # what this test checks, so every run here gets one fixed, recorded-looking peak.
    peak = hardware.MatmulPeak(1e11, "fixed by the test")
    monkeypatch.setattr(loop, "matmul_peak", lambda device, precision: peak)
    exp = load_experiment(path)
    res = compare(path, out=tmp_path, smoke=True, device="cpu", log=lambda m: None)
    assert res.trained == [(v, exp.seeds[0]) for v in exp.variants]
    assert all(s["step"] == 2 for s in res.summaries)
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    for variant in exp.variants:
        assert f"| `{variant}` |" in report
    for name in exp.eval.inference:
        assert f"| `{name}` (" in report
    assert all(p.is_file() for p in res.plots)
    assert len(res.plots) == 2 + bool(exp.eval.lengths) + (exp.eval.passkey is not None)
