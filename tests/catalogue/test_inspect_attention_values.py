"""Bad inputs to ``lmlab inspect`` and ``lmlab attention``: one ``error:`` line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "tiny.yaml")


def one_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--seq-len", "-3"], "--seq-len must be >= 1, got -3"),
        (["--context", "0"], "--context must be >= 1, got 0"),
        (["--dtype", "float7"], "unknown dtype 'float7'; allowed: bf16, bfloat16"),
        (["--set", "model.attention.n_heads=5"], "model.d_model (64) must be divisible"),
    ],
)
def test_inspect_bad_flags(capsys, argv: list[str], expected: str):
    assert expected in one_error(capsys, "inspect", TINY, *argv)


def test_inspect_missing_path(capsys, tmp_path: Path):
    assert f"not found: {tmp_path / 'nope'}" in one_error(capsys, "inspect", str(tmp_path / "nope"))


def test_inspect_set_on_a_loaded_model_is_refused(capsys, tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    msg = one_error(capsys, "inspect", str(tmp_path), "--set", "model.d_model=8")
    assert "--set applies to a config file or an lmlab run folder" in msg


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--layer", "2"], "--layer 2 is out of range: the model has 2 layers (0..1)"),
        (["--layer", "-1"], "--layer -1 is out of range"),
        (["--head", "4"], "--head 4 is out of range: the model has 4 heads per layer (0..3)"),
        (["--text", ""], "--text is empty"),
        (["--text", "A" * 40], "--text is 40 tokens, more than the model's context of 32"),
        (["--text", "中"], "outside this character-level vocabulary"),
    ],
)
def test_attention_bad_flags(capsys, tiny_run: Path, tmp_path: Path, argv, expected):
    args = ["attention", str(tiny_run), "--text", "ROMEO", "--out", str(tmp_path / "m"), *argv]
    assert expected in one_error(capsys, *args)
    assert not (tmp_path / "m").exists()  # nothing written on a refused request


def test_attention_output_folder_that_is_a_file(capsys, tiny_run: Path, tmp_path: Path):
    (tmp_path / "f").write_text("x")
    msg = one_error(
        capsys, "attention", str(tiny_run), "--text", "RO", "--out", str(tmp_path / "f")
    )
    assert "cannot create the output folder" in msg


def test_attention_missing_model(capsys, tmp_path: Path):
    assert "not found" in one_error(capsys, "attention", str(tmp_path / "x"), "--text", "a")
