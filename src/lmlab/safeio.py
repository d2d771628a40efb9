"""Reading files that lmlab did not write (or that someone may have replaced): bounded, typed.

Every file lmlab reads is untrusted. Before a byte is read, :func:`regular_file` checks that the
path is a regular file (not a FIFO, which would block ``open`` forever; not ``/dev/zero``, which
never ends; not a folder; not a symlink loop) and that it is no larger than the reader's bound.
The readers then read at most that bound, decode UTF-8 and parse JSON into plain values, raising
one :class:`~lmlab.errors.LmlabError` (or the subclass the caller names) that says which file and
why. JSON is parsed strictly: ``NaN``/``Infinity`` and duplicate object keys are refused. YAML
(:func:`parse_yaml`) is plain data only, duplicate keys refused, and bounded: at most
:data:`YAML_MAX_NODES` values once aliases are expanded, :data:`YAML_MAX_DEPTH` levels deep.

Bounds are in bytes. The defaults are far above what any honest file of each kind holds.
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml

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


def inside(
    folder: str | Path,
    name: str,
    what: str,
    error: type[LmlabError] = LmlabError,
    outside: str | None = None,
) -> Path:
    """``folder / name`` for a relative ``name`` read from a file, refused when it is absolute,
    holds ``..``, is a symlink loop, or resolves (through symlinks) outside ``folder``.
    ``outside``: the message for the last case (default: one naming ``what`` and ``name``)."""
    base = Path(folder)
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\x00" in name:
        raise error(f"{what} names {name!r}, which is not a path inside {base}")
    target = base / rel
    try:
        resolved, root = target.resolve(), base.resolve()
    except RuntimeError:  # a symlink loop (Python < 3.13)
        raise error(f"{what} {target} is a symlink loop") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP
            raise error(f"{what} {target} is a symlink loop") from None
        raise error(f"{what} names {name!r}, which cannot be resolved inside {base}") from None
    if resolved != root and root not in resolved.parents:
        raise error(
            outside or f"{what} names {name!r}, which leads outside {base} (through a symlink)"
        )
    return target


# ----------------------------------------------------------------------------- YAML

YAML_MAX_NODES = 100_000  # scalars + sequences + mappings, counted with every alias expanded
YAML_MAX_DEPTH = 32  # nesting levels (a config nests 4)
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_nodes(root: yaml.Node, where: str, error: type[LmlabError]) -> None:
    """Refuse a YAML node graph that expands (through aliases) to more than
    :data:`YAML_MAX_NODES` nodes or nests deeper than :data:`YAML_MAX_DEPTH` (an alias to a node
    that contains it nests forever), or a mapping that repeats a key (merge keys ``<<`` aside:
    the keys a mapping sets itself override merged ones). Sizes are memoised per node, so an
    alias bomb is measured without being expanded."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > YAML_MAX_DEPTH:
            raise error(
                f"{where} nests more than {YAML_MAX_DEPTH} levels deep (or an alias refers to a "
                f"node that contains it), at line {node.start_mark.line + 1}"
            )
        if id(node) in sizes:
            return sizes[id(node)]
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
            seen: set[str] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    if key.value in seen:
                        raise error(
                            f"{where} repeats the key {key.value[:80]!r} in one mapping (line "
                            f"{key.start_mark.line + 1}); YAML keeps only the last: remove one"
                        )
                    seen.add(key.value)
        n = 1
        for child in children:
            n += size(child, depth + 1)
            if n > YAML_MAX_NODES:
                raise error(
                    f"{where} holds more than {YAML_MAX_NODES:,} YAML values once its aliases "
                    "(*name) are expanded; lmlab reads at most that many"
                )
        sizes[id(node)] = n
        return n

    size(root, 0)


def yaml_problem(e: Exception) -> str:
    """One line for a YAML or decoding error: the problem and where (line, column; 1-based)."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (invalid byte at offset {e.start})"
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def is_yaml(text: str) -> bool:
    """Whether ``text`` parses as YAML at all (composing is linear in its length: no alias is
    expanded)."""
    try:
        yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return False
    return True


def parse_yaml(text: str, where: str, error: type[LmlabError] = LmlabError) -> Any:
    """Plain data from YAML text (PyYAML's SafeLoader: no tag builds a Python object), bounded:
    duplicate keys refused, at most :data:`YAML_MAX_NODES` values after alias expansion and
    :data:`YAML_MAX_DEPTH` levels; aliases and merge keys (``<<: *base``) are allowed within
    those bounds. Raises ``error`` naming ``where``; never echoes the text."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where, error)
        return loader.construct_document(node)
    except LmlabError:
        raise
    except yaml.YAMLError as e:
        raise error(f"{where} is not valid YAML: {yaml_problem(e)}") from None
    except RecursionError:
        raise error(f"{where} nests too deeply to be YAML lmlab reads") from None
    except (ValueError, TypeError, OverflowError) as e:  # a bad date, a 5000-digit integer
        raise error(f"{where} is not valid YAML: {yaml_problem(e)}") from None
    finally:
        loader.dispose()


def read_yaml(
    path: str | Path,
    what: str = "file",
    max_bytes: int = SMALL_FILE,
    error: type[LmlabError] = LmlabError,
) -> Any:
    """:func:`parse_yaml` of a regular UTF-8 file of at most ``max_bytes``."""
    p = Path(path)
    raw = read_bytes(p, what, max_bytes, error)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} {p} is not valid YAML: {yaml_problem(e)}") from None
    return parse_yaml(text, f"{what} {p}", error)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple = 3, 6, 6, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 80, 80, 40


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few items and characters, for error messages (a value read from
    a file may be huge, or an alias graph of a billion leaves)."""
    return _SHORT.repr(value)
