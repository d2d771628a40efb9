"""Output folders written all at once: a reader of ``--out`` sees nothing or the whole result.

``lmlab export`` and ``lmlab import`` write into a temporary sibling folder (``.NAME.tmp-PID``),
fsync every file in it, and rename it onto ``--out`` at the end; any error on the way removes the
temporary folder and leaves ``--out`` as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmlab.errors import LmlabError
from lmlab.fsutil import fsync_path


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a file, or a non-empty folder unless ``force``."""
    if out.exists() and not out.is_dir():
        raise LmlabError(f"--out {out} is a file; give a folder to write into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LmlabError(f"--out {out} is not empty; choose another folder or pass --force")


def check_not_source(out: str | Path, source: str | Path) -> None:
    """Refuse an ``--out`` that is the model being read or a folder holding it: with --force it
    would replace the model (a run's checkpoints, a .gguf beside it) with the written copy."""
    o, s = Path(out).resolve(), Path(source).resolve()
    if s == o or o in s.parents:
        raise LmlabError(
            f"--out {out} would replace the model it reads ({source}); choose another folder"
        )


@contextmanager
def staged_folder(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on normal exit it replaces ``out``.

    Raises LmlabError (before anything is written) when ``out`` is a file, or a non-empty
    folder and not ``force``; or when the parent folder cannot be written.
    """
    final = Path(out)
    check_out(final, force)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise LmlabError(f"cannot write beside --out {final}: {e.strerror or e}") from None
    try:
        yield tmp
        for f in sorted(tmp.rglob("*"), reverse=True):  # files before the folders holding them
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
