"""Crash-safe file writes: a file is either its old content or its new one, never half of each.

A run killed at any moment (SIGKILL, power loss) must stay resumable, so files that a resumed run
rewrites (``config.yaml``, ``metrics.jsonl``) go through :func:`atomic_write_text`: the text is
written to a temporary file beside the target, fsynced, renamed over the target, and the folder
fsynced so the rename itself is durable.

A write that meets a full disk or a read-only folder is answered with one LmlabError naming the
path and the bytes needed (:func:`check_free_space` before, :func:`writing` around the write);
output paths are checked before anything is written (:func:`check_out_path`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmlab.errors import LmlabError


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically (temporary file, fsync, rename, fsync folder).

    Raises OSError when the folder is not writable; the old file is then left untouched.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding=encoding) as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_path(target.parent)


# ---------------------------------------------------------------- full disks, read-only folders

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
SLACK_BYTES = 1 << 20  # kept free beyond an estimate (file system metadata, small files)


def human_bytes(n: float) -> str:
    """``n`` bytes as text, e.g. '1.5 MB (1,500,000 bytes)' (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({int(n):,} bytes)"
    return f"{int(n):,} bytes"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (where a new file under it would land)."""
    p = Path(os.path.abspath(path))
    while not os.path.exists(p) and p != p.parent:  # os.path: False for any OSError
        p = p.parent
    return p


def free_bytes(folder: str | Path) -> int:
    """Bytes free for an unprivileged writer on the file system holding ``folder``."""
    return shutil.disk_usage(_existing(Path(folder))).free


def check_free_space(folder: str | Path, needed: int, what: str) -> None:
    """Raise LmlabError before writing ``what`` (about ``needed`` bytes) into ``folder`` when the
    file system there has less free (plus a 1 MiB slack): nothing is written."""
    free = free_bytes(folder)
    if free < needed + SLACK_BYTES:
        raise LmlabError(
            f"no space left on device for {what} in {folder}: it needs about "
            f"{human_bytes(needed)}, {human_bytes(free)} are free there; free some space and "
            "run the command again"
        )


def write_error(e: OSError, path: str | Path, needed: int | None = None) -> LmlabError | None:
    """The one-line LmlabError for a write to ``path`` that failed for want of space (ENOSPC,
    EDQUOT) or permission (read-only file system, EACCES, EPERM); None for any other OSError."""
    where = e.filename or path
    if e.errno in NO_SPACE:
        need = f" (it needs about {human_bytes(needed)})" if needed else ""
        return LmlabError(
            f"no space left on device writing {where}{need}; {human_bytes(free_bytes(path))} "
            "are free there. Free some space and run the command again; what was saved before "
            "is intact"
        )
    if e.errno in READ_ONLY:
        why = (
            "is on a read-only file system"
            if e.errno == errno.EROFS
            else f"cannot be written ({e.strerror})"
        )
        return LmlabError(f"{where} {why}; lmlab needs to write there")
    return None


@contextmanager
def writing(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Turn a full-disk or read-only OSError raised inside the block into one LmlabError naming
    ``path`` (and the ``needed`` bytes); other errors pass unchanged. The caller cleans up."""
    try:
        yield
    except OSError as e:
        err = write_error(e, path, needed)
        if err is None:
            raise
        raise err from None


# ---------------------------------------------------------------- --out values


def check_out_path(
    path: str | Path, flag: str = "--out", folder: bool = True, what: str = "the output"
) -> Path:
    """Refuse an output path before anything is written: ``path`` (a folder when ``folder``,
    else a file) that is the other kind, lies under a file, has a name longer than its file
    system allows (NAME_MAX, usually 255 bytes), or is the file-system root. Returns it."""
    p = Path(path)
    try:
        name_max = os.pathconf(_existing(p.parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in p.parts:  # first: stat() of a name too long raises ENAMETOOLONG
        size = len(os.fsencode(part))
        if size > name_max:
            raise LmlabError(
                f"{flag} {p}: the name {part[:40]}... is {size} bytes long, more than the file "
                f"system allows ({name_max}); choose a shorter name"
            )
    if folder and os.path.abspath(p) == os.path.abspath(os.sep):
        raise LmlabError(f"{flag} {p} is the file-system root; give a folder for {what}")
    if os.path.exists(p) and folder and not os.path.isdir(p):
        kind = "a file" if os.path.isfile(p) else "not a folder (a FIFO, socket or device)"
        raise LmlabError(f"{flag} {p} is {kind}; give a folder for {what}")
    if os.path.exists(p) and not folder and os.path.isdir(p):
        raise LmlabError(f"{flag} {p} is a folder; give a file name")
    for parent in p.parents:
        if os.path.exists(parent):
            if not os.path.isdir(parent):
                raise LmlabError(f"{flag} {p} is under {parent}, which is a file, not a folder")
            break
    return p
