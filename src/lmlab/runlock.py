"""One writer per folder: an exclusive ``fcntl.flock`` on a lock file holding the writer's pid.

``RUN/.lmlab-run`` is a run folder's lock file and, because only lmlab writes it, the mark that
lmlab made the folder. ``lmlab train`` (fresh and ``--resume``) holds it for the whole run;
``lmlab import`` / ``export`` hold it on a run folder they replace, and a lock beside the folder
they write (``.NAME.lock``, removed again) while they stage it. A second writer is refused with
one message naming the holder's pid. The kernel releases a flock when its process dies (SIGKILL,
power loss), so a lock left by a killed process is simply taken over: the pid in the file is
only what the message reports, never what decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path
from types import TracebackType

from lmlab.errors import LmlabError
from lmlab.fsutil import write_error

LOCK_FILE = ".lmlab-run"
_PID_BYTES = 32  # the most read back from a lock file (a pid and a newline)


class FolderLock:
    """A held lock; :meth:`release` (or leaving a ``with`` block) gives it back, emptying a kept
    lock file (so a run folder's bytes do not change with the pid of each reader-writer)."""

    def __init__(self, path: Path, fd: int, unlink: bool) -> None:
        self.path, self._fd, self._unlink = path, fd, unlink

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._unlink:  # while still held: a waiter that opened this inode retries
                os.unlink(self.path)
            else:  # the pid is no longer the holder's (the file stays: it marks the folder)
                os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def holder_pid(fd: int) -> str:
    """The pid written in an open lock file, as text ('unknown' when unreadable)."""
    try:
        text = os.pread(fd, _PID_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def lock_folder(folder: str | Path, lock_path: str | Path | None = None) -> FolderLock:
    """Take the exclusive lock of ``folder`` (an existing folder): ``lock_path`` (default
    ``folder/.lmlab-run``, kept after release; any other path is removed on release).

    Never blocks. Raises LmlabError naming the holder's pid when another process (or another
    open of the same lock) holds it, or when the lock file cannot be created (read-only folder,
    full disk) or is not a regular file (a FIFO or symlink put in its place).
    """
    target = Path(folder)
    path = Path(lock_path) if lock_path is not None else target / LOCK_FILE
    unlink = lock_path is not None
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(100):  # retried only when a releasing holder removed the file meanwhile
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            err = write_error(e, path)
            if err is not None:
                raise err from None
            raise LmlabError(f"cannot lock {target}: {path}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LmlabError(
                    f"cannot lock {target}: its lock file {path} is not a regular file; remove it"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LmlabError(
                    f"{target} is being written by another lmlab process (pid {holder_pid(fd)}); "
                    "wait for it to finish or stop it, or choose another folder"
                ) from None
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a file its holder had just removed: try the new one
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                err = write_error(e, path)
                if err is not None:
                    raise err from None
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return FolderLock(path, fd, unlink)
    raise LmlabError(f"cannot lock {target}: its lock file {path} keeps being replaced")


def lock_beside(folder: str | Path) -> FolderLock:
    """The lock of a folder that is about to be (re)placed whole: ``PARENT/.NAME.lock`` (the
    parent must exist; the file is removed on release). See :func:`lock_folder`."""
    target = Path(folder)
    return lock_folder(target, target.parent / f".{target.name}.lock")
