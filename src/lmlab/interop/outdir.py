"""Output folders written all at once: a reader of ``--out`` sees nothing or the whole result.

``lmlab export`` and ``lmlab import`` write into a temporary sibling folder (``.NAME.tmp-PID``),
fsync every file in it, and rename it onto ``--out`` at the end; any error on the way removes the
temporary folder and leaves ``--out`` as it was. One writer at a time: the folder is locked while
it is staged (:mod:`lmlab.runlock`).
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from lmlab.errors import LmlabError
from lmlab.fsutil import check_free_space, check_out_path, fsync_path, write_error, writing
from lmlab.runlock import LOCK_FILE, lock_beside, lock_folder


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a file or under one, the file-system root, a name too long
    for its file system (:func:`lmlab.fsutil.check_out_path`), or a non-empty folder unless
    ``force``."""
    check_out_path(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LmlabError(f"--out {out} is not empty; choose another folder or pass --force")


def check_not_source(out: str | Path, source: str | Path) -> None:
    """Refuse an ``--out`` that is the model being read, a folder holding it, or something that
    exists inside it (a run's config.yaml or checkpoints/): with --force it would replace the
    model, or part of it, with the written copy. A new name inside a source folder is allowed."""
    o, s = Path(out).resolve(), Path(source).resolve()
    if s == o or o in s.parents:
        raise LmlabError(
            f"--out {out} would replace the model it reads ({source}); choose another folder"
        )
    if s in o.parents and (o.exists() or o.is_symlink()):
        raise LmlabError(
            f"--out {out} is inside the model it reads ({source}): writing it would replace part "
            "of that model; choose a name outside it"
        )


@contextmanager
def staged_folder(
    out: str | Path, force: bool = False, needed_bytes: int | None = None
) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on normal exit it replaces ``out``.

    The writer holds ``out``'s lock (:func:`lmlab.runlock.lock_beside`, and the run lock inside
    ``out`` when it is a run folder, e.g. one being trained) from the first check to the rename,
    so a second writer is refused naming its pid; temporary folders left beside ``out`` by a
    killed writer are removed first. Raises LmlabError (before anything is written) when ``out``
    is a file, or a non-empty folder and not ``force``; when the parent folder cannot be
    written; and, with the temporary folder removed and ``out`` as it was, when a write in the
    block meets a full disk or a read-only folder (naming ``needed_bytes``, the estimated size
    of what is written, when given: then the free space is also checked before writing).
    """
    final = Path(out)
    check_out(final, force)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmlabError(f"cannot write beside --out {final}: {e.strerror or e}") from None
    with ExitStack() as locks:
        locks.enter_context(lock_beside(final))
        check_out(final, force)  # again, now that no other lmlab writer can change it
        if (final / LOCK_FILE).is_file():  # a run folder: refused while its run is writing it
            locks.enter_context(lock_folder(final))
        for stale in [
            *final.parent.glob(f".{glob.escape(final.name)}.tmp-*"),
            *final.parent.glob(f".{glob.escape(final.name)}.old-*"),
        ]:
            if stale.is_dir() and not stale.is_symlink():  # left by a killed writer
                shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        if needed_bytes is not None:
            check_free_space(final.parent, needed_bytes, f"--out {final}")
        try:
            tmp.mkdir()
        except OSError as e:
            err = write_error(e, tmp)
            reason = str(err) if err is not None else e.strerror or str(e)
            raise LmlabError(f"cannot write beside --out {final}: {reason}") from None
        try:
            with writing(tmp, needed_bytes):
                yield tmp
                for f in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
                    fsync_path(f)
                fsync_path(tmp)
                old = final.parent / f".{final.name}.old-{os.getpid()}"
                if final.exists():  # empty, or --force
                    os.replace(final, old)
                os.replace(tmp, final)
                fsync_path(final.parent)
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
