"""Small value checks a variant's ``check`` and :mod:`lmlab.validation` share.

Each raises :class:`~lmlab.errors.ConfigError` naming the dotted field (``where``). This module
sits below the components (it imports only :mod:`lmlab.errors`), so a variant's file can use it.
"""

from __future__ import annotations

from collections.abc import Iterable

from lmlab.errors import ConfigError


def positive(value: float | None, where: str, allow_zero: bool = False) -> None:
    """Refuse NaN and values < 0 (or <= 0 unless ``allow_zero``); None (derived) passes."""
    if value is None:
        return
    if value != value:  # NaN passes every comparison below
        raise ConfigError(f"{where} must be a number, got nan")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where} must be {bound}, got {value}")


def choice(value: str, allowed: Iterable[str], where: str) -> None:
    """Refuse a ``value`` not among ``allowed``, listing them in order."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{where}: {value!r} is not allowed; allowed: {', '.join(allowed)}")
