"""``--plugin FILE.py``: import a user's one-file component, which registers itself.

A plugin is a single Python file that registers one or more variants with the public decorators
(``@POSITION.register("xpos")`` ...); see docs/extending.md and examples/plugins/. Importing it
runs its code, by design: this happens only for a file named by an explicit ``--plugin`` flag,
never for anything read from a run folder or config.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lmlab.errors import LmlabError
from lmlab.registry import Registry, families

Registered = list[tuple[Registry, str]]  # (registry, variant name) a plugin added


def _names() -> set[tuple[str, str]]:
    return {(f, n) for f, reg in families().items() for n in reg.names()}


def load_plugin(path: str | Path) -> Registered:
    """Import the Python file ``path``; return the variants it registered (in the order of
    :func:`lmlab.registry.families`). Raises LmlabError (one line, no traceback) when the file
    does not exist, its import fails (the exception's last line) or it registers nothing."""
    import lmlab.models  # noqa: F401  (the built-in variants first: a plugin's are the new ones)
    import lmlab.models.init  # noqa: F401

    p = Path(path)
    if p.suffix != ".py" or not p.is_file():
        raise LmlabError(f"--plugin {path}: not a Python file (give the path of a .py file)")
    before = _names()
    module = f"lmlab_plugin_{p.stem}"
    spec = importlib.util.spec_from_file_location(module, p)
    if spec is None or spec.loader is None:
        raise LmlabError(f"--plugin {path}: cannot be imported as a Python module")
    sys.modules[module] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(sys.modules[module])
    except Exception as e:  # the user's code: its last line, not a traceback
        unload(_added(before))
        sys.modules.pop(module, None)
        lines = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__
        raise LmlabError(f"--plugin {path}: importing it failed: {detail}") from None
    added = _added(before)
    if not added:
        raise LmlabError(
            f"--plugin {path}: registers no component (decorate a class with a registry's "
            "register, e.g. @POSITION.register('xpos'); see docs/extending.md)"
        )
    return added


def _added(before: set[tuple[str, str]]) -> Registered:
    regs = families()
    return [(regs[f], n) for f, reg in regs.items() for n in reg.names() if (f, n) not in before]


def unload(registered: Registered) -> None:
    """Unregister what :func:`load_plugin` registered (an in-process caller runs again clean)."""
    for registry, name in registered:
        if name in registry:
            registry.unregister(name)


def load_plugins(paths: Sequence[str | Path] | None) -> Registered:
    """:func:`load_plugin` each of ``paths`` in order; all they registered (none: [])."""
    out: Registered = []
    try:
        for path in paths or ():
            out += load_plugin(path)
    except LmlabError:
        unload(out)
        raise
    return out


@contextmanager
def plugins(paths: Sequence[str | Path] | None) -> Iterator[Registered]:
    """Load ``paths`` for the duration of a command; unregister them after it."""
    registered = load_plugins(paths)
    try:
        yield registered
    finally:
        unload(registered)
