"""Command-line values: each bad value gets one ``error:`` line naming the flag, exit 2; an
extreme but meaningful value is handled, never a NaN or an ``error: unexpected``."""

from __future__ import annotations

from pathlib import Path

import pytest
from catalogue_helpers import assert_one_error, run_cli

# sampling values
# Checked before the model is read, so MODEL need not exist; generate and chat share the check
# (lmlab.generation.sampling.check_sampling).

BAD_SAMPLING_VALUES = [
    ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ("--temperature", "nan", "--temperature must be a finite number"),
    ("--temperature", "inf", "--temperature must be a finite number"),
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
