"""Compile-on-first-use for lmlab's C++ kernels, safe against a build that was killed.

``torch.utils.cpp_extension.load`` guards each build folder with a ``lock`` file it creates and
deletes itself (``FileBaton``); a process killed while compiling (Ctrl-C in the first 10-30 s of
the first run, an OOM kill) leaves that file behind, and every later ``load`` of the same name
then waits for it forever, silently. :func:`build` runs ``load`` under a lock the kernel drops
when its holder dies (``fcntl.flock`` on ``<folder>.flock``): whoever holds it is the only lmlab
process building into that folder, so a ``lock`` file found there is a dead build's and is
removed first. A build running in another process is waited for at most :data:`WAIT_S` seconds
(then :class:`TimeoutError`, which the callers turn into their torch fallback with the reason).

Folders: ``<torch's build root>/lmlab_py<major><minor>_torch<version>/<name>`` (the root is
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, as torch's own), one per source and
flag set (``name`` carries the flag set, as the callers choose it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

WAIT_S = 600.0  # the longest wait for another process's build of the same kernels, seconds
POLL_S = 0.2


def build_dir(name: str) -> Path:
    """The folder lmlab builds extension ``name`` in (created by :func:`build`)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"lmlab_py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(root) / tag / name


def build(name: str, sources: list[str], cflags: list[str], ldflags: list[str]) -> Path:
    """Compile ``sources`` into a shared library (or reuse the cached one) and return its path.
    Raises whatever the compiler or loader raises, and TimeoutError after :data:`WAIT_S` s of
    waiting for another process that is building the same ``name``."""
    from torch.utils.cpp_extension import load

    folder = build_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own baton only
        fcntl = None  # type: ignore[assignment]
    with open(folder.with_name(name + ".flock"), "a+b") as held:
        if fcntl is not None:
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another process has been building {name} in {folder} for over "
                            f"{WAIT_S:.0f} s"
                        ) from None
                    time.sleep(POLL_S)
            (folder / "lock").unlink(missing_ok=True)  # a killed build's baton: nobody holds it
        path = load(
            name=name,
            sources=sources,
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    return Path(path)
