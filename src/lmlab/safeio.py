"""Reading files that lmlab did not write (or that someone may have replaced): bounded, typed.

Every file lmlab reads is untrusted. Before a byte is read, :func:`regular_file` checks that the
path is a regular file (not a FIFO, which would block ``open`` forever; not ``/dev/zero``, which
never ends; not a folder; not a symlink loop) and that it is no larger than the reader's bound.
The readers then read at most that bound, decode UTF-8 and parse JSON into plain values, raising
one :class:`~lmlab.errors.LmlabError` (or the subclass the caller names) that says which file and
why. JSON is parsed strictly: ``NaN``/``Infinity`` and duplicate object keys are refused.

Bounds are in bytes. The defaults are far above what any honest file of each kind holds.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from lmlab.errors import LmlabError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SMALL_FILE = 16 * MiB  # configs, state files, JSON indexes, chat templates, tokenizer specs
TEXT_FILE = 4 * GiB  # corpora


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def regular_file(
    path: str | Path,
    what: str = "file",
    max_bytes: int | None = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> os.stat_result:
    """Check that ``path`` is an existing regular file of at most ``max_bytes`` (None: any size).

    Symlinks are followed (a loop is refused). Returns its ``os.stat_result``. Raises ``error``
    naming ``what`` and ``path`` for a missing file, a folder, FIFO, device or socket, a symlink
    loop, a file that cannot be read, or one over the bound.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP
            raise error(f"{what} {p} is a symlink loop") from None
        raise error(f"cannot read {what} {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {p} is {_kind(st.st_mode)}, not a regular file") from None
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(
            f"{what} {p} is {st.st_size:,} bytes, more than the {max_bytes:,} lmlab reads for it"
        )
    return st


def read_bytes(
    path: str | Path,
    what: str = "file",
    max_bytes: int = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (see :func:`regular_file`)."""
    regular_file(path, what, max_bytes, error)
    try:
        # O_NONBLOCK: should the path have been swapped for a FIFO since the check, open returns
        # at once instead of waiting for a writer (and the read below then finds no data).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {path} is more than the {max_bytes:,} bytes lmlab reads for it")
    return data


def read_text(
    path: str | Path,
    what: str = "file",
    max_bytes: int = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> str:
    """A regular file of at most ``max_bytes``, decoded as UTF-8 (a BOM is dropped)."""
    data = read_bytes(path, what, max_bytes, error)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str, what: str, error: type[LmlabError] = LmlabError) -> Any:
    """Strict JSON: NaN/Infinity and duplicate keys refused. Raises ``error`` naming ``what``."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be JSON lmlab reads") from None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise error(f"{what} is not valid JSON: {e}") from None


def read_json(
    path: str | Path,
    what: str = "file",
    max_bytes: int = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> Any:
    """A regular UTF-8 file of at most ``max_bytes`` parsed as strict JSON (:func:`parse_json`)."""
    return parse_json(read_text(path, what, max_bytes, error), f"{what} {path}", error)


def read_json_object(
    path: str | Path,
    what: str = "file",
    max_bytes: int = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> dict[str, Any]:
    """:func:`read_json` that also requires a JSON object at the top."""
    value = read_json(path, what, max_bytes, error)
    if not isinstance(value, dict):
        raise error(f"{what} {path} must hold a JSON object, not {type(value).__name__}")
    return value


def inside(folder: str | Path, name: str, what: str, error: type[LmlabError] = LmlabError) -> Path:
    """``folder / name`` for a relative ``name`` read from a file, refused when it is absolute,
    holds ``..``, or resolves (through symlinks) outside ``folder``."""
    base = Path(folder)
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\x00" in name:
        raise error(f"{what} names {name!r}, which is not a path inside {base}")
    target = base / rel
    try:
        resolved, root = target.resolve(), base.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop on older Pythons
        raise error(f"{what} names {name!r}, which cannot be resolved inside {base}") from None
    if resolved != root and root not in resolved.parents:
        raise error(f"{what} names {name!r}, which leads outside {base} (through a symlink)")
    return target
