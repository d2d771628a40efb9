"""Command-line values: each bad value gets one ``error:`` line naming the flag, exit 2, before
anything is loaded, trained or started; an extreme but meaningful value is handled, never a NaN
or an ``error: unexpected``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import TINY, assert_one_error, run_cli

# sampling values
# Checked before the model is read, so MODEL need not exist; generate and chat share the check
# (lmlab.generation.sampling.check_sampling).

BAD_SAMPLING_VALUES = [
    ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ("--temperature", "nan", "--temperature must be a finite number"),
    ("--temperature", "inf", "--temperature must be a finite number"),
    ("--temperature", "1e308", "--temperature must be at most 3.403e+38 (float32's largest"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
    ("--top-p", "nan", "--top-p must be a finite number"),
    ("--top-k", "-1", "--top-k must be >= 0, got -1"),
    ("--repetition-penalty", "0", "--repetition-penalty must be > 0, got 0.0"),
    ("--repetition-penalty", "-1.5", "--repetition-penalty must be > 0, got -1.5"),
    ("--repetition-penalty", "inf", "--repetition-penalty must be a finite number"),
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(("flag", "value", "message"), BAD_SAMPLING_VALUES)
def test_a_bad_sampling_value_is_one_error_line(command, flag, value, message, tmp_path, capsys):
    code, _, err = run_cli(capsys, command, tmp_path / "model", flag, value)
    assert_one_error(code, err, message)


def _generate(capsys, run: Path, *flags: str) -> str:
    code, out, err = run_cli(
        capsys, "generate", run, "--prompt", "ROMEO:", "--max-new-tokens", "24", "--no-prompt",
        "--seed", "3", *flags,
    )  # fmt: skip
    assert code == 0 and "error" not in err, err
    return out


@pytest.mark.parametrize("temperature", ["1e-45", "5e-324"])
def test_a_temperature_too_small_for_float32_acts_as_greedy(temperature, tiny_run, capsys):
    greedy = _generate(capsys, tiny_run, "--temperature", "0")
    assert _generate(capsys, tiny_run, "--temperature", temperature) == greedy


@pytest.mark.parametrize("penalty", ["1e-45", "5e-324", "1e300"])
def test_an_extreme_repetition_penalty_generates_without_nan(penalty, tiny_run, capsys):
    out = _generate(capsys, tiny_run, "--temperature", "0.8", "--repetition-penalty", penalty)
    assert out.strip()


def test_a_top_k_above_the_vocabulary_samples_from_every_token(tiny_run, capsys):
    top_all = _generate(capsys, tiny_run, "--temperature", "0.8", "--top-k", "1000000")
    assert top_all == _generate(capsys, tiny_run, "--temperature", "0.8")


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
