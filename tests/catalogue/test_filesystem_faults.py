"""Full disks, read-only folders and --out values that must not be written: one ``error:`` line
naming the path (and the bytes needed), nothing half-written left behind, the previous state
(checkpoint, ``latest``, the user's files) intact. A full disk is simulated by making the write
or the free-space probe fail (no real full disk needed); read-only by an EROFS from the write."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

import lmlab.data.dataset as dataset
import lmlab.fsutil as fsutil
import lmlab.training.checkpoint as checkpoint
from tests.helpers import assert_one_error, assert_unchanged, run_cli, snapshot

TINY = [
    *("--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.max_seq_len=32"),
    *("--set", "train.batch_size=4", "--set", "train.eval_batches=2", "--set", "train.log_every=1"),
    *("--set", "train.precision=fp32", "--set", "train.warmup_steps=3", "--no-progress"),
]
RUN_FILES = ("config.yaml", "tokenizer.json", "checkpoints", "data")


@pytest.fixture
def run(tiny_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


def fail_with(code: int, after: int = 0):
    """A stand-in for a write function that works ``after`` times, then raises OSError(code)."""
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise OSError(code, "simulated", str(args[-1]) if args else None)
        return real(*args, **kwargs)

    real = checkpoint.save_file
    return write


def checkpoints_of(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    "code, needle", [(errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only")]
)
def test_a_failed_checkpoint_write_on_resume_keeps_the_previous_one(
    run: Path, capsys, monkeypatch, code: int, needle: str
):
    before = snapshot(run / "checkpoints")
    monkeypatch.setattr(checkpoint, "save_file", fail_with(code))  # the optimizer file
    code_, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")
    line = assert_one_error(code_, err, needle, str(run / "checkpoints"))
    if code == errno.ENOSPC:
        assert "it needs about" in line and "bytes" in line
    assert_unchanged(run / "checkpoints", before)  # step-30 and latest untouched
    assert checkpoints_of(run) == ["latest", "step-000030"]  # no temporary folder left
    monkeypatch.undo()
    assert run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")[0] == 0


def test_a_full_disk_at_a_later_checkpoint_never_removes_a_fresh_run(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.setattr(checkpoint, "save_file", fail_with(errno.ENOSPC, after=1))
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--max-steps", "4", "--set", "train.checkpoint_every=2"]
    code, _, err = run_cli(capsys, *argv, *TINY)
    assert_one_error(code, err, "no space left on device", "bytes")
    assert all((out / name).exists() for name in RUN_FILES)  # the run is still there
    assert (out / "checkpoints" / "latest").read_text() == "step-000002\n"
    assert checkpoints_of(out) == ["latest", "step-000002"]


def test_too_little_free_space_is_refused_before_a_checkpoint_is_written(
    run: Path, capsys, monkeypatch
):
    before = snapshot(run / "checkpoints")
    real = fsutil.free_bytes
    monkeypatch.setattr(
        fsutil, "free_bytes", lambda p: 1000 if "checkpoints" in str(p) else real(p)
    )
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")
    line = assert_one_error(code, err, "no space left on device for checkpoint step-000031")
    assert "(1,000 bytes) are free" in line and "it needs about" in line
    assert_unchanged(run / "checkpoints", before)
    assert checkpoints_of(run) == ["latest", "step-000030"]


def test_checkpoint_bytes_counts_tied_weights_once_and_the_optimizer_state():
    import torch

    from lmlab.models.build import build_model
    from tests.helpers import tiny_model_config

    model = build_model(tiny_model_config(vocab_size=50, tie_embeddings=True))
    weights = {t.data_ptr(): t.numel() * 4 for t in model.state_dict().values()}
    opt = {"a::exp_avg": torch.zeros(10), "a::step": torch.tensor(1.0)}
    assert checkpoint.checkpoint_bytes(model, None) == sum(weights.values()) + 64 * 1024
    assert checkpoint.checkpoint_bytes(model, opt) == sum(weights.values()) + 44 + 64 * 1024


def test_resuming_a_run_on_a_read_only_file_system_is_one_error(run: Path, capsys, monkeypatch):
    import os

    import lmlab.runlock as runlock

    class ReadOnly:  # the os module, except that creating or opening for writing fails
        def __getattr__(self, name):
            return getattr(os, name)

        def open(self, path, flags, *args):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(runlock, "os", ReadOnly())
    before = snapshot(run)
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")
    assert_one_error(code, err, str(run / ".lmlab-run"), "read-only file system")
    assert snapshot(run) == before


# ---------------------------------------------------------------------------- token cache


def test_too_little_space_for_the_token_cache_is_one_error_naming_the_bytes(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.setattr(fsutil, "free_bytes", lambda p: 0)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "2", *TINY)
    line = assert_one_error(code, err, "no space left on device for the token cache")
    assert str(out / "data") in line and "it needs about" in line


@pytest.mark.parametrize(
    "code, needle", [(errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only")]
)
def test_a_failed_token_cache_write_leaves_no_temporary_file(
    tmp_path: Path, capsys, monkeypatch, code: int, needle: str
):
    def broken_open(path, *args, **kwargs):
        raise OSError(code, "simulated", str(path))

    monkeypatch.setattr(dataset, "open", broken_open, raising=False)
    out = tmp_path / "run"
    out.mkdir()  # not created by lmlab train: stays, and what is in it is lmlab's only
    code_, _, err = run_cli(capsys, "train", "--out", str(out), "--max-steps", "2", *TINY)
    assert_one_error(code_, err, needle, str(out / "data"))
    assert not list(out.rglob("*.tmp"))


# ---------------------------------------------------------------------------- export / import


def test_a_full_disk_during_export_leaves_nothing_half_written(
    run: Path, tmp_path: Path, capsys, monkeypatch
):
    import lmlab.interop.export as export

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(export, "save_file", full)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    before = snapshot(out)
    code, _, err = run_cli(capsys, "export", str(run), "--out", str(out), "--force")
    assert_one_error(code, err, "no space left on device", "model.safetensors", "needs about")
    assert_unchanged(out, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no .hf.tmp-* left


def test_too_little_space_for_an_export_is_refused_before_writing(
    run: Path, tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.setattr(fsutil, "free_bytes", lambda p: 0)
    out = tmp_path / "hf"
    code, _, err = run_cli(capsys, "export", str(run), "--out", str(out))
    assert_one_error(code, err, f"no space left on device for --out {out}", "needs about")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_temporary_folders_of_a_killed_import_are_removed_by_the_next(
    run: Path, tmp_path: Path, capsys
):
    out = tmp_path / "imported"
    for stale in (".imported.tmp-99999", ".imported.old-99999"):  # a killed writer's pid
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "model.safetensors").write_bytes(b"x")
    assert run_cli(capsys, "import", str(run), "--out", str(out))[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported", "run"]


# ---------------------------------------------------------------------------- --out values


def test_train_refuses_a_folder_it_did_not_write(tmp_path: Path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "metrics.jsonl").write_text("not lmlab's\n")
    before = snapshot(out)
    argv = ["train", "--out", str(out), "--max-steps", "2", *TINY]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, f"--out {out} is not empty", "not an lmlab run", "--overwrite")
    assert snapshot(out) == before  # nothing written, nothing removed
    code, _, err = run_cli(capsys, *argv, "--overwrite")  # the way forward: only run entries
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "checkpoints" / "latest").is_file()


def test_overwrite_starts_a_finished_run_afresh_and_keeps_other_files(run: Path, capsys):
    (run / "notes.txt").write_text("keep")
    argv = ["train", "--out", str(run), "--max-steps", "2", *TINY]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, "already holds a run", f"--resume {run}", "--overwrite")
    assert run_cli(capsys, *argv, "--overwrite")[0] == 0
    assert checkpoints_of(run) == ["latest", "step-000002"]
    assert (run / "notes.txt").read_text() == "keep"


def test_a_config_inside_the_out_folder_is_never_replaced(tmp_path: Path, capsys):
    out = tmp_path / "exp"
    out.mkdir()
    config = out / "config.yaml"
    config.write_text("name: mine\n# my comments\n")
    for extra in ([], ["--overwrite"]):
        argv = ["--config", str(config), "--out", str(out), "--max-steps", "1", *TINY, *extra]
        code, _, err = run_cli(capsys, "train", *argv)
        assert_one_error(code, err, f"--config {config}", "writes its resolved config")
    assert config.read_text() == "name: mine\n# my comments\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]


def test_overwrite_cannot_delete_the_init_from_model(run: Path, capsys):
    before = snapshot(run)
    argv = ["train", "--init-from", str(run), "--out", str(run), "--overwrite", "--max-steps", "1"]
    code, _, err = run_cli(capsys, *argv)
    assert_one_error(code, err, f"--out {run} holds the --init-from model")
    assert snapshot(run) == before


def test_out_the_root_folder_is_refused(capsys):
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(capsys, "train", "--out", "/", "--max-steps", "1", *TINY, *extra)
        assert_one_error(code, err, "--out / is the file-system root")


def test_a_run_name_too_long_for_the_file_system_is_refused_up_front(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    long = "r" * 300
    for argv in (["--out", str(tmp_path / long)], ["--set", f"name={long}"]):
        code, _, err = run_cli(capsys, "train", *argv, "--max-steps", "1", *TINY)
        assert_one_error(code, err, "more than the file system allows")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even runs/ was created


def command_writing(out: str, run: Path) -> dict[str, list[str]]:
    return {
        "train": ["train", "--out", out, "--max-steps", "1", *TINY],
        "export": ["export", str(run), "--out", out],
        "import": ["import", str(run), "--out", out],
        "compare": ["compare", "experiments/positions.yaml", "--out", out, "--smoke"],
    }


@pytest.mark.parametrize("command", ["train", "export", "import", "compare"])
def test_an_out_under_a_file_is_one_error_naming_the_file(
    run: Path, tmp_path: Path, capsys, command: str
):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep")
    out = str(blocker / "sub")
    code, _, err = run_cli(capsys, *command_writing(out, run)[command])
    assert_one_error(code, err, f"is under {blocker}, which is a file, not a folder")
    assert blocker.read_text() == "keep"


@pytest.mark.parametrize("command", ["train", "export", "import", "compare"])
def test_an_out_that_is_a_file_is_one_error(run: Path, tmp_path: Path, capsys, command: str):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep")
    code, _, err = run_cli(capsys, *command_writing(str(blocker), run)[command])
    assert_one_error(code, err, f"--out {blocker} is a file")
    assert blocker.read_text() == "keep"
