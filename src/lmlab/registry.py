"""A tiny name -> component table, one per component family, and what each variant declares.

Each family (attention, position, norm, ffn, block, ...) keeps one :class:`Registry`. Variants
register under the field's standard name; the model asks for ``cfg.<family>.kind`` once, so adding a
variant touches one file and shows up in ``lmlab list``, the docs table and the contract tests.

A variant owns its **contract** (:class:`Contract`), declared next to its forward:

- ``options``: the fields of its config section that this kind reads and that not every kind of
  the family reads (``rope_theta`` for ``position.kind=rope``). An option of the family set on a
  kind that does not declare it is refused, naming the kind(s) that do.
- ``check(cfg)``: its own validation (raise :class:`~lmlab.errors.ConfigError` naming the dotted
  field), called by :func:`lmlab.validation.validate_run_config` only when it is selected. It
  receives the :class:`~lmlab.config.ModelConfig` for a ``model.*`` family and the whole
  :class:`~lmlab.config.RunConfig` for a ``data.*`` or ``train.*`` one.
- ``fields``: config fields the variant adds to its section, ``name -> (type, default)``
  (``{"xpos_scale_base": (float, 512.0)}``): read as ``cfg.model.position.xpos_scale_base``
  (the default when unset), parsed and written by :mod:`lmlab.config` with no edit there, and
  options of this kind (refused on the others).
- ``examples``: the option combinations worth testing, each a nested mapping of ``model``
  overrides (``{"attention": {"mask": "sliding_window", "window": 4}}``) to which the registry
  adds the variant's own name at :attr:`Registry.field`. The contract tests
  (``tests/contract/``, ``lmlab verify --plugin``) run every example on every model kind that
  accepts it.

A class declares them as class attributes (``options``, ``examples``) and a ``check``
classmethod or staticmethod; a function variant (a mask, a router) passes them to
:meth:`Registry.register` as keywords. Costs that cannot be measured from the module (KV-cache
bytes, non-matmul FLOPs) are methods of the variant class itself (see :mod:`lmlab.nn.attention`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from lmlab.errors import ConfigError

T = TypeVar("T")

_FAMILIES: dict[str, Registry] = {}

CheckFn = Callable[[Any], None]


@dataclass(frozen=True)
class Contract:
    """What a registered variant declares besides its forward (module docstring)."""

    options: tuple[str, ...] = ()
    check: CheckFn | None = None
    examples: tuple[dict[str, Any], ...] = ({},)
    fields: dict[str, tuple[type, Any]] = field(default_factory=dict)


class Registry(Generic[T]):
    """Maps standard names to the classes or functions implementing one component family.

    ``field`` is the dotted config field naming the variant (``model.position.kind``); None for a
    family chosen in code. Lookup by name: ``REG.get(name)`` (a ConfigError with did-you-mean
    and the allowed names) or ``REG[name]`` (KeyError); ``name in REG``, ``list(REG)`` (names in
    registration order), ``len(REG)`` and ``REG.items()`` work as on a dict.

    ``notes`` is the family's markdown conventions and guidance (layouts, cache kinds, which
    variant to reach for), set in the family's module next to the code and printed under its
    table by ``lmlab list --markdown`` (docs/components.md).
    """

    notes: str = ""

    def __init__(self, family: str, field: str | None = None) -> None:
        self.family = family
        self.field = field  # the config field that names a variant, e.g. model.position.kind
        self._items: dict[str, T] = {}
        self._docs: dict[str, str] = {}
        self._contracts: dict[str, Contract] = {}
        _FAMILIES[family] = self

    def register(
        self,
        name: str,
        doc: str = "",
        *,
        options: tuple[str, ...] | None = None,
        check: CheckFn | None = None,
        examples: tuple[dict[str, Any], ...] | None = None,
        fields: dict[str, tuple[type, Any]] | None = None,
    ) -> Callable[[T], T]:
        """Decorator: register ``obj`` under ``name`` (raises ValueError on a duplicate name).

        ``options``, ``check``, ``examples`` and ``fields`` declare the variant's
        :class:`Contract`; when left out they are read from the object's attributes of the same
        names (a class's ``options``/``examples``/``fields`` class attributes and ``check``
        classmethod), else empty. A declared field is one of the kind's options."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.family} kind {name!r} is registered twice")
            self._items[name] = obj
            text = (doc or getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0]
            self._docs[name] = " ".join(text.split())
            own = dict(fields if fields is not None else getattr(obj, "fields", {}))
            declared = tuple(options if options is not None else getattr(obj, "options", ()))
            self._contracts[name] = Contract(
                options=declared + tuple(n for n in own if n not in declared),
                check=check if check is not None else getattr(obj, "check", None),
                examples=tuple(
                    examples if examples is not None else getattr(obj, "examples", ({},))
                ),
                fields=own,
            )
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin's variant after its contract run; KeyError if absent)."""
        del self._items[name]
        self._docs.pop(name, None)
        self._contracts.pop(name, None)

    def get(self, name: str, field: str | None = None) -> T:
        """Return the variant called ``name``; raise :class:`ConfigError` listing valid names."""
        if name not in self._items:
            where = field or self.field or f"{self.family}.kind"
            hint = difflib.get_close_matches(name, self._items, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            plugin = "; a plugin's kind needs its file again: --plugin FILE.py"
            raise ConfigError(
                f"{where}: unknown {self.family} kind {name!r}{extra}; "
                f"allowed: {', '.join(self.names())}"
                + (plugin if (self.field or "").startswith("model.") and not hint else "")
            )
        return self._items[name]

    def contract(self, name: str) -> Contract:
        """The :class:`Contract` declared by ``name`` (ConfigError for an unknown name)."""
        self.get(name)
        return self._contracts[name]

    def owners(self, option: str) -> list[str]:
        """The kinds that declare ``option`` among their options, in registration order."""
        return [n for n, c in self._contracts.items() if option in c.options]

    def names(self) -> list[str]:
        """All registered names, in registration order."""
        return list(self._items)

    def describe(self) -> dict[str, str]:
        """Name -> one-line description (the first docstring line)."""
        return dict(self._docs)

    # dict-like access, so a registry can stand where a plain name -> object dict was
    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def keys(self) -> list[str]:
        return list(self._items)


def families() -> dict[str, Registry]:
    """Every component family registered so far (import :mod:`lmlab.nn` first to fill them)."""
    return dict(_FAMILIES)
