"""Which folder ``lmlab train`` may write a run into, and what it removes from one.

A folder lmlab made for a run holds ``.lmlab-run`` (its lock file, :mod:`lmlab.runlock`), so a
folder lmlab did not make is recognised. For a new run into ``DIR`` (``--out``):

- ``DIR`` missing or empty: created or used.
- made by lmlab and holding no checkpoint (an attempt that failed or was stopped before its first
  checkpoint): started afresh; its metrics, TensorBoard events and loss plot are removed, the token
  cache is reused.
- holding a checkpoint: refused; ``--resume DIR`` continues it, ``--overwrite`` starts it afresh
  (removing the run's own files, :data:`RUN_ENTRIES`).
- any other non-empty folder: refused; ``--overwrite`` writes the run into it, replacing only the
  entries a run folder has (:data:`RUN_ENTRIES`); every other file stays as it was.

The folder's lock is taken before anything in it is removed or written and held for the whole
run, so a second writer (a second ``lmlab train --out DIR`` or ``--resume DIR``) is refused with
the first one's pid and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lmlab.errors import LmlabError
from lmlab.fsutil import check_out_path, write_error
from lmlab.run import CONFIG_FILE, TOKENIZER_FILE
from lmlab.runlock import LOCK_FILE, FolderLock, lock_folder
from lmlab.safeio import inside
from lmlab.training.checkpoint import has_checkpoint
from lmlab.training.metrics import METRICS_FILE

# Every entry a run folder gets from lmlab train (the lock file aside).
RUN_ENTRIES = (CONFIG_FILE, TOKENIZER_FILE, "data", "checkpoints", METRICS_FILE, "tb", "loss.png")
STALE_ENTRIES = (METRICS_FILE, "tb", "loss.png")  # an attempt with no checkpoint left these


@dataclass
class RunFolder:
    """A run folder claimed by this process: ``created`` when this call made it; ``lock`` held
    until :meth:`release` (None on ranks other than 0 and for a folder that is not a run)."""

    path: Path
    created: bool
    lock: FolderLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def made_by_lmlab(folder: Path) -> bool:
    return (folder / LOCK_FILE).exists() or has_checkpoint(folder)


def _check_new_run_folder(run_dir: Path, overwrite: bool) -> None:
    """Refuse (before anything is written) a folder a new run must not be written into."""
    check_out_path(run_dir, "--out", what="the run")
    if not run_dir.is_dir() or overwrite:
        return
    if has_checkpoint(run_dir):
        raise LmlabError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir}, choose another "
            "--out, or pass --overwrite to start it afresh (its checkpoints are deleted)"
        )
    try:
        entries = sorted(p.name for p in run_dir.iterdir())
    except OSError as e:
        raise LmlabError(f"cannot read --out {run_dir}: {e.strerror or e}") from None
    if entries and LOCK_FILE not in entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise LmlabError(
            f"--out {run_dir} is not empty and is not an lmlab run folder (it holds {shown}); "
            "choose another --out, or pass --overwrite to write the run into it (only the "
            f"entries a run writes are replaced: {', '.join(RUN_ENTRIES)})"
        )


def _remove(run_dir: Path, names: tuple[str, ...]) -> None:
    for name in names:
        path = run_dir / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        except OSError as e:
            err = write_error(e, path)
            raise err if err is not None else e from None


def claim_new_run(run_dir: Path, overwrite: bool = False, is_main: bool = True) -> RunFolder:
    """Create (or reuse) ``run_dir`` for a new run, lock it and clear what an earlier attempt
    left (see the module docstring). Ranks other than 0 (``is_main`` False) only check.

    Raises LmlabError, with nothing changed, for a folder that is a file or under one, the
    file-system root, a name too long for the file system, a folder holding a run or files
    lmlab did not write (unless ``overwrite``), a folder another process is writing (naming its
    pid), or one that cannot be created.
    """
    _check_new_run_folder(run_dir, overwrite)
    if not is_main:
        return RunFolder(run_dir, False, None)
    created = False
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
        created = True
    except FileExistsError:
        if not run_dir.is_dir():
            raise LmlabError(f"--out {run_dir} is a file; give a folder for the run") from None
    except OSError as e:
        err = write_error(e, run_dir)
        reason = str(err) if err is not None else e.strerror or str(e)
        raise LmlabError(f"cannot create run folder {run_dir}: {reason}") from None
    try:
        lock = lock_folder(run_dir)
    except LmlabError:
        if created:  # empty unless another process locked it meanwhile: then it is theirs
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    try:
        _check_new_run_folder(run_dir, overwrite)  # again, now that no one else can write it
        _remove(run_dir, RUN_ENTRIES if overwrite else STALE_ENTRIES)
    except BaseException:
        lock.release()
        raise
    return RunFolder(run_dir, created, lock)


def claim_resumed_run(run_dir: Path, is_main: bool = True) -> RunFolder:
    """Lock the run folder ``run_dir`` for ``--resume`` (rank 0; a folder that is not a run is
    left alone, for :func:`lmlab.run.read_run_config` to refuse). Raises LmlabError naming the
    pid of another process writing it, or a loss.png or tb/ that is a symlink
    leading outside it."""
    if not is_main or not (run_dir / CONFIG_FILE).is_file():
        return RunFolder(run_dir, False, None)
    # written without being read first (the other entries are checked where they are read)
    for entry in ("tb", "loss.png"):
        if os.path.lexists(run_dir / entry):
            inside(
                run_dir,
                entry,
                entry,
                outside=(
                    f"{run_dir / entry} leads outside {run_dir} (a symlink); a resumed run reads "
                    "and writes its files only inside its folder"
                ),
            )
    return RunFolder(run_dir, False, lock_folder(run_dir))
