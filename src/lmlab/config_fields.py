"""Field machinery of the config schema: a YAML value coerced to a field's type, a nested mapping
turned into dataclass sections (unknown fields refused with a did-you-mean), and the sections whose
kind a registry chooses, which also hold the fields their variants declare.

Generic over dataclasses: it imports neither :mod:`lmlab.config` nor any component; the
registries are read through :func:`lmlab.registry.families` when a field is not the schema's.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from lmlab.errors import ConfigError
from lmlab.safeio import short_repr

# ----------------------------------------------------------------------------- variant fields


def variant_fields(path: str) -> dict[str, tuple[type, Any]]:
    """The fields the registered kinds of the family at ``path`` (``model.position``: the family
    whose field is ``model.position.kind``) declare: name -> (type, default), first kind first.
    Only families imported so far count (:func:`lmlab.registry.families`)."""
    from lmlab.registry import families

    out: dict[str, tuple[type, Any]] = {}
    for reg in families().values():  # the section's kind and its other choices (mask)
        if (reg.field or "").rpartition(".")[0] == path:
            for kind in reg:
                for name, spec in reg.contract(kind).fields.items():
                    out.setdefault(name, spec)
    return out


def _kind_fields(section: VariantSection) -> dict[str, tuple[type, Any]]:
    """The fields declared by the kinds ``section`` selects: its ``kind`` and any other choice
    a registry names (``model.attention.mask``); none for a name not registered."""
    from lmlab.registry import families

    out: dict[str, tuple[type, Any]] = {}
    for reg in families().values():
        parent, _, selector = (reg.field or "").rpartition(".")
        kind = str(section.__dict__.get(selector, "")) if parent == section._path else ""
        for name, spec in (reg.contract(kind).fields if kind in reg else {}).items():
            out.setdefault(name, spec)
    return out


class VariantSection:
    """A section whose ``kind`` a registry chooses: it also holds the fields its variants declare
    (``_extra``, set from YAML or ``--set``), read as attributes (the declared default when
    unset) and written by :meth:`lmlab.config.RunConfig.to_dict` for the selected kind."""

    _path: ClassVar[str] = ""
    _extra: dict[str, Any]

    def __post_init__(self) -> None:
        """A variant field set to the selected kind's declared default is the same config as
        one left unset: drop it, so equality and the YAML round trip see one value."""
        extra = self.__dict__.get("_extra")
        if extra:
            declared = _kind_fields(self)
            for name in [n for n, v in extra.items() if n in declared and v == declared[n][1]]:
                del extra[name]

    def to_dict(self) -> dict[str, Any]:
        """This section as nested plain dicts, its variant fields included (:func:`section_dict`;
        ``dataclasses.asdict`` would give the raw ``_extra`` mapping instead)."""
        return section_dict(self)

    if not TYPE_CHECKING:  # mypy keeps refusing misspelt attributes of the schema's own fields

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            extra = self.__dict__.get("_extra") or {}
            if name in extra:
                return extra[name]
            declared = variant_fields(self._path)
            if name in declared:
                return declared[name][1]
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def section_dict(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` of a section, with the variant fields of a :class:`VariantSection`
    after its own: those its selected kind declares (the default when unset) and any set."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        out[f.name] = section_dict(value) if dataclasses.is_dataclass(value) else value
    if isinstance(obj, VariantSection):
        for name, (_, default) in _kind_fields(obj).items():
            out[name] = obj._extra.get(name, default)
        out.update(obj._extra)
    return out


# ----------------------------------------------------------------------------- dict <-> dataclass

C = TypeVar("C")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {short_repr(value)}")
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value) if isinstance(value, str) else _fail(tp, value, where)
        except ValueError:
            pass
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")


def _fail(tp: Any, value: Any, where: str) -> Any:
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {short_repr(value)}")


def from_dict(cls: type[C], data: dict[str, Any], prefix: str) -> C:
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        declared = _declared_fields(cls) if key not in names else {}
        if key in declared:  # a field a variant of this section declares
            extra[key] = _coerce(value, declared[key][0], where)
        elif key not in names:
            hint = _did_you_mean(cls, str(key), prefix)
            more = f" (did you mean {hint!r}?)" if hint else ""
            allowed = ", ".join(names + [n for n in _declared_fields(cls) if n not in names])
            raise ConfigError(f"unknown config field {where!r}{more}; allowed: {allowed}")
        else:
            kwargs[key] = _coerce(value, hints[key], where)
    if extra:
        kwargs["_extra"] = extra
    return cls(**kwargs)


def _declared_fields(cls: type) -> dict[str, tuple[type, Any]]:
    """The variant fields of section ``cls`` (none unless a :class:`VariantSection`). Registers
    the built-in components first (importing :mod:`lmlab.validation`, which imports them), so a
    field of a built-in variant parses however this module was reached."""
    if not issubclass(cls, VariantSection):
        return {}
    import importlib

    importlib.import_module("lmlab.validation")
    return variant_fields(cls._path)


def _leaf_fields(cls: type, prefix: str) -> list[tuple[str, str]]:
    """(dotted path, field name) of every field in the nested sections of ``cls``."""
    out: list[tuple[str, str]] = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            path = f"{prefix}.{name}" if prefix else name
            out += [(f"{path}.{leaf}", leaf) for leaf in _field_names(tp)]
            out += _leaf_fields(tp, path)
    return out


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def _did_you_mean(cls: type, key: str, prefix: str) -> str | None:
    """The field meant by an unknown ``key`` of section ``cls`` (at ``prefix``): a field of the
    section by its bare name, or a field of a section nested in it by its dotted path
    (``model.n_heads`` -> ``model.attention.n_heads``), whichever is spelt closest (a nested
    field spelt exactly ``key`` wins)."""
    names = _field_names(cls)
    nested = _leaf_fields(cls, prefix)
    exact = [path for path, leaf in nested if leaf == key]
    if exact:
        return exact[0]
    candidates = {name: name for name in names}
    for path, leaf in nested:
        candidates.setdefault(leaf, path)
    best = difflib.get_close_matches(key, list(candidates), n=1)
    return candidates[best[0]] if best else None
