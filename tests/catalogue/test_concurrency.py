"""Two writers of one folder, and stale locks: the second writer gets one error naming the
first's pid and changes nothing; a lock left by a dead process is taken over."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmlab.training.metrics import read_metrics
from tests.helpers import TRAIN_SET, assert_one_error, assert_unchanged, run_cli, snapshot

LOCK_FILE = ".lmlab-run"  # lmlab.runlock.LOCK_FILE

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
HOLD = (
    "import sys; from lmlab.runlock import lock_folder, lock_beside; from pathlib import Path; "
    "lock = (lock_beside if sys.argv[2] == 'beside' else lock_folder)(Path(sys.argv[1])); "
    "print('locked', flush=True); sys.stdin.read(); lock.release()"
)


class Holder:
    """Another process holding the lock of ``folder`` (``how``: 'run' inside it, 'beside')
    until it is told to stop."""

    def __init__(self, folder: Path, how: str = "run") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder), how],
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "locked\n"

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture
def run(tiny_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


def test_two_trains_into_one_folder_the_second_is_refused_and_the_first_finishes(
    tmp_path: Path, capsys
):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lmlab", "train", "--out", str(out), "--max-steps", "100000"]
    with open(tmp_path / "stderr", "w") as stderr:
        first = subprocess.Popen([*cmd, *TRAIN_SET], env=ENV, stderr=stderr)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any(
                "train_loss" in r for r in read_metrics(out)
            ):
                time.sleep(0.05)
            assert first.poll() is None, (tmp_path / "stderr").read_text()
            for argv in (["--out", str(out), *TRAIN_SET], ["--resume", str(out)]):
                code, _, err = run_cli(capsys, "train", *argv, "--max-steps", "5")
                assert_one_error(code, err, str(out), f"pid {first.pid}", "another lmlab process")
            assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
        finally:
            first.send_signal(signal.SIGTERM)
            first.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert first.returncode == 143, err  # the first run stopped normally, with a checkpoint
    assert "Traceback" not in err
    steps = [r["step"] for r in read_metrics(out) if "train_loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # its metrics were never cut
    assert run_cli(capsys, "train", "--resume", str(out), "--max-steps", str(steps[-1] + 1))[0] == 0


@pytest.mark.parametrize("command", ["resume", "import", "export", "overwrite"])
def test_a_second_writer_of_a_locked_run_folder_is_refused(
    run: Path, tmp_path: Path, capsys, command: str
):
    source = tmp_path / "source"
    shutil.copytree(run, source)
    before = snapshot(run)
    argv = {
        "resume": ["train", "--resume", str(run), "--max-steps", "31"],
        "import": ["import", str(source), "--out", str(run), "--force"],
        "export": ["export", str(source), "--out", str(run), "--force"],
        "overwrite": ["train", "--out", str(run), "--overwrite", "--max-steps", "2", *TRAIN_SET],
    }[command]
    with Holder(run) as holder:
        code, _, err = run_cli(capsys, *argv)
        assert_one_error(code, err, str(run), f"pid {holder.proc.pid}")
    assert_unchanged(run, before)
    assert not list(tmp_path.glob(".run.*"))  # no staging folder or lock file left beside it


def test_a_second_import_into_the_same_new_folder_is_refused(run: Path, tmp_path: Path, capsys):
    out = tmp_path / "new"
    with Holder(out, "beside") as holder:
        code, _, err = run_cli(capsys, "import", str(run), "--out", str(out))
        assert_one_error(code, err, str(out), f"pid {holder.proc.pid}")
    assert not out.exists()
    assert run_cli(capsys, "import", str(run), "--out", str(out))[0] == 0  # free again
    assert not (tmp_path / ".new.lock").exists()  # the lock beside is removed after use


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_left_by_a_killed_process_is_taken_over(run: Path, tmp_path: Path, capsys):
    (run / LOCK_FILE).write_text(f"{dead_pid()}\n")  # its flock died with it
    assert run_cli(capsys, "train", "--resume", str(run), "--max-steps", "31")[0] == 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / LOCK_FILE).write_text(f"{dead_pid()}\n")  # an lmlab attempt killed at once
    code, _, err = run_cli(capsys, "train", "--out", str(fresh), "--max-steps", "2", *TRAIN_SET)
    assert code == 0, err
    assert (fresh / "checkpoints" / "latest").is_file()


def test_the_lock_names_its_holder_and_is_free_once_released(tmp_path: Path):
    from lmlab.runlock import lock_folder

    lock = lock_folder(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    with pytest.raises(Exception, match=f"pid {os.getpid()}"):
        lock_folder(tmp_path)  # another open file description: refused, even in this process
    lock.release()
    lock_folder(tmp_path).release()
