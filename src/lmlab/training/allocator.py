"""Keep freed CPU memory in the process between training steps (glibc's malloc thresholds).

Why: a training step allocates and frees the same large tensors every step (activations kept for
backward, their gradients, attention scores, logits). glibc's ``malloc`` serves a block larger
than ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and gives it back to the kernel on ``free``; it
also returns the top of its heap to the kernel once more than ``M_TRIM_THRESHOLD`` bytes there are
free. By default the first is 128 KiB, raised each time a larger mapped block is freed up to
32 MiB (on 64-bit), and the second is twice the first. Memory given back is new to the process the
next time: the kernel zeroes every 4 KiB page on its first write (a *minor page fault*), which
can cost more than the matmul that writes it (more so in a virtual machine). Measured on 2-core
machines of this project (benchmarks/README.md, "Page faults"): the Mini-GPT step
(``configs/minigpt.yaml``, bf16) took about 25,000 minor faults a step, about none with these
thresholds; it ran 1.20x faster on one machine, 1.03-1.04x on another (what a fault costs
depends on the machine and its hypervisor); resident memory stayed the same.

What: :func:`keep_freed_memory` raises both thresholds (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``)
through glibc's ``mallopt``, once per process, so blocks up to 256 MiB come from the heap and up
to 512 MiB of freed heap stays mapped for the next step. The trade-off: the process's resident
memory stays near its peak instead of shrinking between steps (at most ``TRIM_THRESHOLD`` above
what is in use). It is process-wide (every later allocation, not only lmlab's), which is why it
is applied only where lmlab owns the loop (:class:`lmlab.training.loop.Trainer` on a CPU) and why
``LMLAB_NO_MALLOC_TUNING=1`` turns it off. A user's own choice wins: nothing is changed when
glibc's own ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` variables or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES`` are set. On a C library other than glibc (musl,
macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Mapping

from lmlab.envflags import opted_out

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20  # bytes: blocks up to this size come from the heap, not from mmap
TRIM_THRESHOLD = 512 << 20  # bytes of free heap kept mapped before malloc returns any
# glibc's own policy at its most generous on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX and the trim
# threshold it sets beside it): what an untuned process reaches at best once large blocks were
# freed. benchmarks/train_step_ab.py --allocator times "untuned" steps with these values.
GLIBC_DEFAULT_MAX = (32 << 20, 64 << 20)

OPT_OUT_ENV = "LMLAB_NO_MALLOC_TUNING"
USER_SETTINGS_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: bool | None = None  # keep_freed_memory's answer, once per process


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded through ctypes; None on another C library or where it cannot be loaded."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")  # glibc's soname: no find_library (it runs ldconfig)
    except OSError:
        return None


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (bytes) with ``mallopt``.

    Setting either turns glibc's dynamic threshold off for the rest of the process. Returns True
    when glibc took both, False on another C library or when it refused a value (glibc refuses an
    mmap threshold above its maximum heap size). Raises ValueError for a size outside mallopt's
    ``int`` (negative or >= 2 GiB)."""
    for value in (mmap_threshold, trim_threshold):
        if not 0 <= value < 2**31:
            raise ValueError(f"a malloc threshold must be 0 <= bytes < 2**31, got {value}")
    libc = _glibc()
    if libc is None:
        return False
    ok_mmap = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)) == 1
    ok_trim = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)) == 1
    return ok_mmap and ok_trim


def tuning_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """False where ``LMLAB_NO_MALLOC_TUNING`` is set (to anything but ``""``, ``0``, ``false``,
    ``no``, ``off``, as ``LMLAB_NO_CPP_KERNELS``) or the user set glibc's malloc thresholds
    themselves (environment or ``GLIBC_TUNABLES``)."""
    env = os.environ if environ is None else environ
    if opted_out(OPT_OUT_ENV, env):
        return False
    if any(name in env for name in USER_SETTINGS_ENV):
        return False
    return "glibc.malloc." not in env.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Raise glibc's thresholds to ``MMAP_THRESHOLD``/``TRIM_THRESHOLD`` once per process (see
    the module docstring); later calls only return the first answer. True when they are in force,
    False when turned off (:func:`tuning_wanted`) or not glibc."""
    global _applied
    if _applied is None:
        _applied = tuning_wanted() and set_malloc_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
    return _applied
