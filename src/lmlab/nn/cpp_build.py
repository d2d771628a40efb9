"""Compile-on-first-use for lmlab's C++ kernels, safe against a build that was killed.

``torch.utils.cpp_extension.load`` guards each build folder with a ``lock`` file it creates and
deletes itself (``FileBaton``); a process killed while compiling (Ctrl-C in the first 10-30 s of
the first run, an OOM kill) leaves that file behind, and every later ``load`` of the same name
then waits for it forever, silently. :func:`build` runs ``load`` under a lock the kernel drops
when its holder dies (``fcntl.flock`` on ``<folder>.flock``): whoever holds it is the only lmlab
process building into that folder, so a ``lock`` file found there is a dead build's and is
removed first. A build running in another process is waited for at most :data:`WAIT_S` seconds,
saying so once on stderr (then :class:`TimeoutError`, which the callers turn into their torch
fallback with the reason). The build folder, its parent and the library must belong to this
user and be writable by nobody else (else PermissionError, the same fallback): ninja keeps a
library newer than its sources, so a folder others can write would let them plant code.

Folders: ``<torch's build root>/lmlab_py<major><minor>_torch<version>/<name>_<tag>`` (the root is
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, as torch's own), one per source and
flag set (``name`` carries the flag set, as the callers choose it) and per checkout: ``tag``
hashes the folders the sources are in (:func:`checkout_tag`), because ninja rebuilds a library
whenever its build command changes, so two clones (or a clone and a worktree) sharing one
folder recompiled every kernel each time the other had run. The first build of a folder says so
on stderr (it takes 10-60 s, and the first training steps wait for it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmlab import envflags
from lmlab.training.hardware import cpu_flags

ENV_OFF = "LMLAB_NO_CPP_KERNELS"
OFF_VALUES = envflags.OFF_VALUES  # LMLAB_NO_CPP_KERNELS values that keep the kernels
WAIT_S = 600.0  # the longest wait for another process's build of the same kernels, seconds
POLL_S = 0.2


def cpu_has_avx2_fma() -> bool:
    """True when torch reports AVX2 (or better) and /proc/cpuinfo lists avx2 and fma."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512f() -> bool:
    """True when torch reports AVX512 and /proc/cpuinfo lists avx512f."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512f" in cpu_flags()


def checkout_tag(sources: list[str]) -> str:
    """Eight hex digits naming the folders ``sources`` are in (resolved): the same for every
    build from one checkout, another for another checkout of the same code."""
    folders = sorted({str(Path(s).resolve().parent) for s in sources})
    return hashlib.sha256("\0".join(folders).encode()).hexdigest()[:8]


def build_dir(name: str, sources: list[str]) -> Path:
    """The folder lmlab builds extension ``name`` from ``sources`` in (created by
    :func:`build`): ``name`` tagged with :func:`checkout_tag` of the sources."""
    name = f"{name}_{checkout_tag(sources)}"
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"lmlab_py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(root) / tag / name


def build(name: str, sources: list[str], cflags: list[str], ldflags: list[str]) -> Path:
    """Compile ``sources`` into a shared library (or reuse the cached one) and return its path.
    Raises whatever the compiler or loader raises, and TimeoutError after :data:`WAIT_S` s of
    waiting for another process that is building the same ``name``."""
    from torch.utils.cpp_extension import load

    folder = build_dir(name, sources)
    name = folder.name  # the library and its lock files are named for the checkout too
    old_umask = os.umask(0o022)  # our folders and files writable by us only, whatever the umask
    try:
        folder.parent.parent.mkdir(parents=True, exist_ok=True)
        folder.parent.mkdir(mode=0o755, exist_ok=True)
        folder.mkdir(mode=0o755, exist_ok=True)
    finally:
        os.umask(old_umask)
    _check_private(folder.parent)
    _check_private(folder)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own baton only
        fcntl = None  # type: ignore[assignment]
    with open(folder.with_name(name + ".flock"), "a+b") as held:
        if fcntl is not None:
            deadline, told = time.monotonic() + WAIT_S, False
            while True:
                try:
                    fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not told:
                        told = True
                        print(
                            f"lmlab: waiting for another process that is building {name} in "
                            f"{folder} (another rank of this run, or another lmlab; at most "
                            f"{WAIT_S:.0f} s)",
                            file=sys.stderr,
                        )
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another process has been building {name} in {folder} for over "
                            f"{WAIT_S:.0f} s"
                        ) from None
                    time.sleep(POLL_S)
            (folder / "lock").unlink(missing_ok=True)  # a killed build's baton: nobody holds it
        libraries = list(folder.glob(name + ".*"))  # what load() would dlopen without rebuilding
        for old in libraries:
            _check_private(old)
        if not libraries:
            print(
                f"lmlab: compiling {name} (once for this checkout: 10-60 s) into {folder}",
                file=sys.stderr,
            )
        old_umask = os.umask(0o022)
        try:
            path = load(
                name=name,
                sources=sources,
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
        finally:
            os.umask(old_umask)
    return Path(path)


def _check_private(path: Path) -> None:
    """Refuse (PermissionError) a build folder or library that another user owns or that group
    or others may write: ninja does not rebuild a library newer than its inputs, so whoever
    can write there could plant code that lmlab would load (TORCH_EXTENSIONS_DIR on a shared
    disk)."""
    if not hasattr(os, "getuid"):
        return
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{path} is not private to this user (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o777:o}): lmlab does not load compiled kernels others could write"
        )


class LazyLibrary:
    """One compiled kernel library, built on first use: :meth:`load` returns it (or None with
    the reason in :meth:`status`: ``LMLAB_NO_CPP_KERNELS`` set, no compiler, a failed build),
    :meth:`available` says whether callers may use it now (False inside :meth:`disabled`).

    ``build`` compiles and loads it (any exception = unavailable); ``describe`` names what was
    built (the status text); ``fallback``, when given, is warned once (RuntimeWarning) with the
    reason when the library cannot be used."""

    def __init__(
        self,
        build: Callable[[], ctypes.CDLL],
        describe: Callable[[ctypes.CDLL], str],
        fallback: str | None = None,
    ) -> None:
        self._build, self._describe, self._fallback = build, describe, fallback
        self.lib: ctypes.CDLL | None = None
        self._status: str | None = None  # None: not tried yet
        self._off = False  # inside disabled()

    def load(self) -> ctypes.CDLL | None:
        """The library (built or loaded on the first call), or None."""
        if self._status is None:
            if envflags.opted_out(ENV_OFF):
                self._status = f"disabled by {ENV_OFF}={os.environ[ENV_OFF]}"
            else:
                try:
                    self.lib = self._build()
                    self._status = self._describe(self.lib)
                except Exception as e:  # no compiler, a failed build, an unloadable library
                    self.lib = None
                    reason = str(e).strip().splitlines()[-1:]
                    self._status = f"unavailable: {type(e).__name__}: {reason}"
            if self.lib is None and self._fallback:
                warnings.warn(f"{self._fallback} ({self._status})", RuntimeWarning, stacklevel=4)
        return self.lib

    def tried(self) -> bool:
        """Whether :meth:`load` has run: its outcome (the library, or why not) is known."""
        return self._status is not None

    def available(self) -> bool:
        """Whether callers may use the library now (built on the first call); False inside
        :meth:`disabled`."""
        return not self._off and self.load() is not None

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block :meth:`available` is False (callers use their torch ops)."""
        before, self._off = self._off, True
        try:
            yield
        finally:
            self._off = before

    def status(self) -> str:
        """What was built (the ``describe`` text), or why it is not used (``not loaded yet``
        before the first use)."""
        return self._status or "not loaded yet"

    def reset(self) -> None:
        """Forget the load result (tests)."""
        self.lib, self._status = None, None
