"""The Hugging Face family record and its registry (:data:`HF_FAMILIES`).

The families themselves live in :mod:`lmlab.interop.families_decoder` and
:mod:`lmlab.interop.families_encoder`; :mod:`lmlab.interop.families` imports both (registering
them in table order) and is the module to import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmlab.config import ModelConfig
from lmlab.errors import LmlabError
from lmlab.registry import Registry


class NotRepresentable(LmlabError):
    """An lmlab config has components the family's Hugging Face class does not have.

    ``family`` names the family; ``missing`` lists every such component as the dotted config
    setting (e.g. ``model.position.kind=alibi``), so a caller can pick the closest family.
    """

    def __init__(self, family: str, missing: list[str]) -> None:
        self.family, self.missing = family, list(missing)
        super().__init__(f"{family} has no counterpart for {'; '.join(self.missing)}")


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face decoder family: names and the maps both ways.

    ``from_config`` (lmlab config -> the HF config class's kwargs, raising NotRepresentable) and
    ``from_state`` (lmlab state dict -> the tensors of the family's ``model.safetensors``, the
    tied LM head left out as ``save_pretrained`` leaves it out) make ``lmlab export`` possible.
    """

    model_type: str  # config.json "model_type"
    hf_class: str  # transformers class of the LM, e.g. "LlamaForCausalLM"
    hf_config_class: str  # e.g. "LlamaConfig"
    to_config: Callable[[Any], ModelConfig]
    to_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    from_config: Callable[[ModelConfig], dict[str, Any]] | None = None
    from_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]] | None = (
        None
    )
    model_kind: str = "decoder"  # the lmlab model.kind it maps onto

    # Adjusts the config to what the tensors hold (e.g. BERT with or without pooler / MLM head).
    fit_config: Callable[[ModelConfig, dict[str, torch.Tensor]], ModelConfig] | None = None

    # The family's own checks of a parsed config.json (its path given), after the generic ones of
    # lmlab.interop.hf_fields: raises LmlabError naming the file and the field or layout refused.
    check_config: Callable[[dict[str, Any], Path], None] | None = None


HF_FAMILIES: Registry[HFFamily] = Registry("hf_family")
