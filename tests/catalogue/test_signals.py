"""Ctrl-C and SIGTERM at awkward moments: before the first checkpoint nothing written is lost
silently; the message says what happened and what is kept."""

from __future__ import annotations

import signal
from pathlib import Path

import lmlab.training.trainer as trainer
from tests.helpers import TRAIN_SET, run_cli, signal_during


def test_a_double_ctrl_c_before_the_first_checkpoint_keeps_the_folder_and_says_so(
    tmp_path: Path, capsys, monkeypatch
):
    signal_during(monkeypatch, 3, signal.SIGINT, signal.SIGINT)  # twice during step 1
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--max-steps", "4", *TRAIN_SET]
    code, _, err = run_cli(capsys, *argv)
    assert code == 130
    line = err.strip()
    assert line.startswith("stopped at once during step 1, without a checkpoint of it"), err
    assert f"{out} keeps what was written so far (no checkpoint)" in line
    assert "the same lmlab train command starts the run afresh" in line
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "data" / "meta.json").is_file()
    assert not (out / "checkpoints" / "latest").exists()
    monkeypatch.undo()
    code, _, err = run_cli(capsys, *argv)  # the same command starts it afresh
    assert code == 0, err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"


def test_ctrl_c_while_the_token_cache_is_built_says_what_is_kept(
    tmp_path: Path, capsys, monkeypatch
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "build_token_cache", interrupted)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "4", *TRAIN_SET)
    assert code == 130
    assert err.strip() == (
        f"interrupted before the first checkpoint; {out} keeps what was written so far (no "
        "checkpoint), and the same lmlab train command starts the run afresh"
    )
    assert out.is_dir()
