"""A tiny name -> component table, one per component family.

Each family (attention, position, norm, ffn, block, ...) keeps one :class:`Registry`. Variants
register under the field's standard name; the model asks for ``cfg.<family>.kind`` once, so adding a
variant touches one file and shows up in ``lmlab list``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

from lmlab.errors import ConfigError

T = TypeVar("T")

_FAMILIES: dict[str, Registry] = {}


class Registry(Generic[T]):
    """Maps standard names to the classes or functions implementing one component family."""

    def __init__(self, family: str, field: str | None = None) -> None:
        self.family = family
        self.field = field  # the config field that names a variant, e.g. model.position.kind
        self._items: dict[str, T] = {}
        self._docs: dict[str, str] = {}
        _FAMILIES[family] = self

    def register(self, name: str, doc: str = "") -> Callable[[T], T]:
        """Decorator: register ``obj`` under ``name`` (raises ValueError on a duplicate name)."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.family} kind {name!r} is registered twice")
            self._items[name] = obj
            text = (doc or getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0]
            self._docs[name] = " ".join(text.split())
            return obj

        return deco

    def get(self, name: str, field: str | None = None) -> T:
        """Return the variant called ``name``; raise :class:`ConfigError` listing valid names."""
        if name not in self._items:
            where = field or f"{self.family}.kind"
            hint = difflib.get_close_matches(name, self._items, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"{where}: unknown {self.family} kind {name!r}{extra}; "
                f"allowed: {', '.join(self.names())}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        """All registered names, in registration order."""
        return list(self._items)

    def describe(self) -> dict[str, str]:
        """Name -> one-line description (the first docstring line)."""
        return dict(self._docs)


def families() -> dict[str, Registry]:
    """Every component family registered so far (import :mod:`lmlab.nn` first to fill them)."""
    return dict(_FAMILIES)
