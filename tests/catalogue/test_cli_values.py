"""Command-line values: a number out of its range gives one error line naming the flag, before
anything is loaded, trained or started."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from catalogue_helpers import assert_one_error, run_cli
from conftest import TINY

# numeric flags

MODEL = "no-such-model"  # the flags are checked before the model is looked for
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["eval", MODEL, "--stride", "1000000000"], "--stride must be <= 16,777,216"),
        (["eval", MODEL, "--max-tokens", "10000000000000000"], "--max-tokens must be <= "),
        (["eval", MODEL, "--batch-size", "1000000000"], "--batch-size must be <= 65,536"),
        (["eval", MODEL, "--lengths", "128,100000000"], "--lengths expects comma-separated"),
        (["generate", MODEL, "--max-new-tokens", "1000000000"], "--max-new-tokens must be <= "),
        (["chat", MODEL, "--max-new-tokens", "1000000000"], "--max-new-tokens must be <= "),
        (["chat", MODEL, "--max-context", "1000000000"], "--max-context must be <= 16,777,216"),
        (["inspect", CONFIG, "--seq-len", "1000000000"], "--seq-len must be <= 16,777,216"),
        (["inspect", CONFIG, "--batch", "1000000000"], "--batch must be <= 1,048,576"),
        (["inspect", CONFIG, "--context", "1000000000000"], "--context must be <= "),
    ],
)
def test_numeric_flag_out_of_range_is_one_error_line(capsys, argv, needle):
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, needle)


def _tiny(tmp: Path) -> Path:
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "max_steps": 1}}))
    return path


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-steps", "1000000000000"], "--max-steps must be <= 1,000,000,000"),
        (["--time-budget", "inf"], "--time-budget must be <= 100,000,000, got inf"),
        (["--time-budget", "1e12"], "--time-budget must be <= 100,000,000"),
    ],
)
def test_train_numeric_flag_out_of_range_trains_nothing(capsys, tmp_path, flags, needle):
    argv = ["train", "--config", _tiny(tmp_path), "--out", tmp_path / "r", *flags]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, needle)
    assert not (tmp_path / "r").exists()


def test_nproc_beyond_the_machine_is_refused_naming_the_cores(capsys, tmp_path, monkeypatch):
    """Was: torchrun started N processes whatever N was."""
    from lmlab.training import distributed

    monkeypatch.setattr(distributed, "available_cores", lambda: 2)
    argv = ["train", "--config", _tiny(tmp_path), "--out", tmp_path / "r", "--nproc", "9"]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, "--nproc 9", "2 cores found", "at most 8 processes")
    assert not (tmp_path / "r").exists()


def test_nproc_over_the_absolute_bound_is_refused(capsys, tmp_path):
    argv = ["train", "--config", _tiny(tmp_path), "--out", tmp_path / "r", "--nproc", "100000"]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, "--nproc 100000", "cores found", "256 in all")
