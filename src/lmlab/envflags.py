"""lmlab's opt-out environment variables (``LMLAB_NO_CPP_KERNELS``, ``LMLAB_NO_MALLOC_TUNING``,
``LMLAB_NO_ONEDNN``), read one way: set to anything but :data:`OFF_VALUES` (after stripping
blanks, any case) turns the feature off; unset or one of them leaves it on."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF_VALUES = ("", "0", "false", "no", "off")  # values that leave the feature on


def opted_out(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the opt-out variable ``name`` in ``environ`` (default ``os.environ``) is set to a
    value outside :data:`OFF_VALUES`."""
    env = os.environ if environ is None else environ
    return env.get(name, "").strip().lower() not in OFF_VALUES
