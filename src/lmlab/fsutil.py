"""Crash-safe file writes: a file is either its old content or its new one, never half of each.

A run killed at any moment (SIGKILL, power loss) must stay resumable, so files that a resumed run
rewrites (``config.yaml``, ``metrics.jsonl``) go through :func:`atomic_write_text`: the text is
written to a temporary file beside the target, fsynced, renamed over the target, and the folder
fsynced so the rename itself is durable.
"""

from __future__ import annotations

import os
from pathlib import Path


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
