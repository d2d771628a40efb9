"""The Hugging Face model families lmlab maps onto its components, in one table.

Each :class:`HFFamily` knows how to read a ``config.json`` (``to_config``), rename a state dict
(``to_state``), and, where lmlab's config has an exact counterpart, write the Hugging Face
config back (``from_config``, used by ``lmlab verify`` to build a reference model). The table is
keyed by ``config.json``'s ``model_type``; the decoder families are defined in
:mod:`lmlab.interop.families_decoder`, the encoder and encoder-decoder ones in
:mod:`lmlab.interop.families_encoder`, registered in that order by importing this module.
"""

from __future__ import annotations

from typing import Any

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.interop import (  # noqa: F401  (register, in order)
    families_decoder,
    families_encoder,
    hf_deepseek_v3,
)
from lmlab.interop.hf_family import HF_FAMILIES, HFFamily, NotRepresentable

__all__ = [
    "HF_FAMILIES",
    "HFFamily",
    "NotRepresentable",
    "family_for",
    "hf_config_json",
    "match_family",
]


def match_family(cfg: ModelConfig) -> tuple[HFFamily, dict[str, Any]]:
    """The Hugging Face family whose class computes exactly what ``cfg`` does, with its config
    kwargs. Raises NotRepresentable for the closest family (fewest mismatched settings), naming
    each component it has no counterpart for, when none fits."""
    refusals: list[NotRepresentable] = []
    for name in HF_FAMILIES.names():
        family = HF_FAMILIES.get(name)
        if family.from_config is None or family.from_state is None:
            continue
        try:
            return family, family.from_config(cfg)
        except NotRepresentable as e:
            refusals.append(e)
    closest = min(refusals, key=lambda e: len(e.missing))
    err = NotRepresentable(closest.family, closest.missing)
    tried = ", ".join(e.family for e in refusals)
    err.args = (
        f"this model has no Hugging Face counterpart: the closest family, {closest.family}, has "
        f"none for {'; '.join(closest.missing)} (families tried: {tried})",
    )
    raise err


def hf_config_json(family: HFFamily, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an exported model: the family's config kwargs (transformers 5
    keys: RoPE settings in ``rope_parameters``) with ``model_type``, ``architectures`` and the
    float32 ``dtype`` of the written weights."""
    return {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "dtype": "float32",
        **kwargs,
    }


def family_for(model_type: str) -> HFFamily:
    """The family of a ``config.json`` ``model_type``; LmlabError lists the supported ones."""
    if model_type not in HF_FAMILIES.names():
        raise LmlabError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: "
            f"{', '.join(HF_FAMILIES.names())}"
        )
    return HF_FAMILIES.get(model_type)
