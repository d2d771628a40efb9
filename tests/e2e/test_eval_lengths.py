"""lmlab eval --lengths: loss per context length over the same text, a plot, inference-time
position scaling, and a clear answer for learned positions past their table."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.cli import main
from lmlab.errors import ConfigError
from lmlab.evaluation.lengths import (
    apply_inference_overrides,
    equal_token_ids,
    eval_lengths,
    parse_lengths,
)
from lmlab.models.build import build_model
from lmlab.training.trainer import train
from tests.helpers import tiny_config, tiny_model_config


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("learned") / "run"
    cfg = tiny_config(model={"position": {"kind": "learned"}}, train={"max_steps": 2})
    train(cfg, out=out, progress=False)
    return out


def table(out: str) -> dict[int, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells[1:]
    return rows


def test_one_row_per_length_and_a_plot(tiny_run: Path, tmp_path: Path, capsys):
    plot = tmp_path / "lengths.png"
    argv = ["eval", str(tiny_run), "--lengths", "16,32,64", "--plot", str(plot)]
    code = main([*argv, "--max-tokens", "2000", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = table(out)
    assert sorted(rows) == [16, 32, 64]
    # 2000 tokens cut to 1 + 31 * 64: the same 1984 tokens scored at every length
    assert {r[2] for r in rows.values()} == {"1984"}
    assert all(math.isfinite(float(r[0])) for r in rows.values())
    assert "past the trained context" in " ".join(rows[64]) and "past" not in " ".join(rows[32])
    assert plot.read_bytes().startswith(b"\x89PNG") and f"plot: {plot}" in out


def test_learned_positions_past_their_table_are_reported_not_crashed(learned_run, tmp_path, capsys):
    code = main(
        ["eval", str(learned_run), "--lengths", "32,64", "--plot", str(tmp_path / "p.png")]
        + ["--max-tokens", "500", "--device", "cpu"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = table(out)
    assert rows[32][0] != "n/a"
    assert rows[64][:2] == ["n/a", "n/a"]
    assert "cannot extrapolate: learned positions have no embedding past position 31" in out
    assert "model.max_seq_len=32" in out


def test_inference_scaling_changes_only_long_positions_rope():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(max_seq_len=32)).eval()
    scaled = apply_inference_overrides(
        model, ["model.position.scaling.kind=yarn", "model.position.scaling.factor=4"]
    )
    assert scaled.cfg.position.scaling.kind == "yarn" and model.cfg.position.scaling.kind == "none"
    for name, p in model.state_dict().items():  # the same weights
        assert torch.equal(p, scaled.state_dict()[name])
    ids = torch.randint(0, 50, (1, 128))
    with torch.no_grad():
        a, b = model(ids).logits, scaled(ids).logits
    assert not torch.allclose(a, b, atol=1e-4)  # the rotation frequencies changed


def test_only_position_scaling_can_change_at_eval():
    model = build_model(tiny_model_config())
    with pytest.raises(ConfigError, match="only inference-time position settings"):
        apply_inference_overrides(model, ["model.d_model=64"])
    with pytest.raises(ConfigError, match="unknown config field 'model.position.scaling.factr'"):
        apply_inference_overrides(model, ["model.position.scaling.factr=2"])
    learned = build_model(tiny_model_config(position={"kind": "learned"}))
    with pytest.raises(ConfigError, match="applies to kind=rope only"):
        apply_inference_overrides(learned, ["model.position.scaling.kind=ntk"])


def test_equal_token_ids_and_parse_lengths():
    ids = np.arange(1000)
    assert len(equal_token_ids(ids, [100, 256])) == 1 + 3 * 256
    assert len(equal_token_ids(ids[:50], [100])) == 50  # nothing fits: unchanged
    assert parse_lengths("128, 256,128") == [128, 256]
    for bad in ("0", "x", "12.5", ""):
        with pytest.raises(Exception, match="--lengths"):
            parse_lengths(bad)


def test_eval_lengths_library_result(tiny_run: Path):
    res = eval_lengths(tiny_run, [32], device="cpu", max_tokens=300)
    assert res.trained_len == 32 and res.position == "rope" and len(res.rows) == 1
    assert res.rows[0].tokens == 9 * 32  # 300 tokens cut to 1 + 9 * 32
