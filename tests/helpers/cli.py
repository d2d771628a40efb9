"""Running the CLI in-process and checking its promise for bad input (tests/catalogue/, e2e).

Every catalogue case runs the CLI in-process and asserts lmlab's promise for bad input: exit code
2, exactly one ``error:`` line that names the cause, no traceback, no ``error: unexpected``, and
(where a folder is involved) nothing that was there before lost or changed.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmlab.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``lmlab ARGV`` in this process. Returns (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code: int, err: str, *needles: str, exit_code: int = 2) -> str:
    """One ``error:`` line holding every needle, exit ``exit_code``, no traceback. Returns it."""
    lines = [line for line in err.strip().splitlines() if line.startswith("error")]
    assert code == exit_code, f"exit {code}: {err}"
    assert len(lines) == 1, err
    assert "unexpected" not in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` by relative path (symlinks by their target text)."""
    result: dict[str, str] = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            result[rel] = "link:" + str(p.readlink())
        elif p.is_file():
            result[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            result[rel] = "dir"
    return result


def assert_unchanged(folder: Path, before: dict[str, str]) -> None:
    """Every file that was under ``folder`` is still there with the same bytes (new ones allowed
    only where the caller says so: compare the snapshots itself for that)."""
    after = snapshot(folder)
    lost = {k: v for k, v in before.items() if after.get(k) != v}
    assert not lost, f"changed or lost under {folder}: {sorted(lost)}"


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail the test (instead of hanging the suite) if the block runs longer than ``seconds``
    (SIGALRM: main thread, Unix)."""

    def stop(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def signal_during(monkeypatch, call: int, *signals: int) -> None:
    """Send ``signals`` to this process from inside the ``call``-th batch draw of training
    (lmlab.training.objectives.sample_batch; the step-0 evaluation of TRAIN_SET draws 2 batches
    first, so call 3 is step 1's batch and call 7 step 5's)."""
    import lmlab.training.objectives as objectives

    real, calls = objectives.sample_batch, []

    def sample_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            for sig in signals:
                os.kill(os.getpid(), sig)  # the handler runs right here
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives, "sample_batch", sample_batch)
