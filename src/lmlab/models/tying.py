"""Tied input and output embeddings that stay tied through every way of loading weights.

Weight tying (Press & Wolf 2017) makes the LM head's (V, D) weight the very ``Parameter`` of the
token embedding. ``load_state_dict`` can silently undo that: with ``assign=True`` it installs one
new ``Parameter`` per name (two tensors, twice the parameters, one of them never trained again),
and a state dict that stores only one of the two names (safetensors keeps one name per shared
tensor; Hugging Face omits ``lm_head.weight``) leaves the other name "missing".
:class:`TiedEmbeddingsModule` closes both holes:

- ``load_state_dict(sd, strict=True)`` accepts a state dict holding either name alone (the other
  is the same matrix); with ``strict=False`` the absent name is still listed in
  ``missing_keys``, as :func:`safetensors.torch.load_model` expects;
- after every load, the model itself or nested in a wrapper, with or without ``assign``, the two
  names are one ``Parameter`` again (holding the loaded values), so parameter counts never change;
- a state dict whose two names hold different values is refused (LmlabError): loading it into a
  tied model would silently keep only one of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lmlab.errors import LmlabError


class TiedEmbeddingsModule(nn.Module):
    """Base of the model families: :meth:`tie_embeddings` ties ``<head>.weight`` to
    ``<embedding>.weight`` for good (see the module docstring)."""

    tied: tuple[str, str] | None = None  # (head module name, embedding module name)

    def tie_embeddings(self, head: str = "lm_head", embedding: str = "embed") -> None:
        """Make ``self.<head>.weight`` the ``Parameter`` ``self.<embedding>.weight`` and keep it
        so across loads."""
        self.tied = (head, embedding)
        self._retie(embedding)
        self._tie_loaded: set[str] = set()  # which of the two names the current load provides
        self.register_load_state_dict_pre_hook(_check_tied_state)
        self.register_load_state_dict_post_hook(_retie_after_load)

    def _retie(self, source: str) -> None:
        """Point both modules' ``weight`` at the ``Parameter`` of module ``source``."""
        assert self.tied is not None
        weight = getattr(self, source).weight
        for name in self.tied:
            module = getattr(self, name)
            if module.weight is not weight:  # an ordinary (copying) load changes nothing here
                module.weight = weight

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """:meth:`torch.nn.Module.load_state_dict`; with ``strict``, a state dict holding only one
        of the two tied names counts as holding both."""
        if self.tied is not None and strict:
            head, embedding = (f"{name}.weight" for name in self.tied)
            if (head in state_dict) != (embedding in state_dict):
                present, absent = (head, embedding) if head in state_dict else (embedding, head)
                completed: OrderedDict[str, Any] = OrderedDict(state_dict)
                completed[absent] = state_dict[present]
                metadata = getattr(state_dict, "_metadata", None)
                if metadata is not None:
                    completed._metadata = metadata  # type: ignore[attr-defined]
                state_dict = completed
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _check_tied_state(
    module: TiedEmbeddingsModule,
    state_dict: dict[str, torch.Tensor],
    prefix: str,
    *_: Any,
) -> None:
    """Before a load: note which tied names the state dict holds; refuse two different values."""
    if module.tied is None:  # untied since (lmlab.nn.quant: the head quantized on its own)
        return
    names = {n: f"{prefix}{n}.weight" for n in module.tied}
    module._tie_loaded = {n for n, key in names.items() if key in state_dict}
    if len(module._tie_loaded) == 2:
        a, b = (state_dict[key] for key in names.values())
        if a is b or a.is_meta or b.is_meta:  # one tensor, or nothing to compare
            return
        if not all(type(t) in (torch.Tensor, nn.Parameter) for t in (a, b)):
            return  # a DTensor shard (FSDP2) or another subclass: its loader checks it
        if a.shape != b.shape or not torch.equal(a, b.to(device=a.device, dtype=a.dtype)):
            first, second = names.values()
            raise LmlabError(
                f"the weights hold different values for {first} and {second}, but this model "
                "ties them (model.tie_embeddings=true); build the model with "
                "model.tie_embeddings=false to load an untied head"
            )


def _retie_after_load(module: TiedEmbeddingsModule, incompatible_keys: Any) -> None:
    """After a load: one ``Parameter`` again, taken from the name the state dict provided (the
    embedding if both); nothing loaded, nothing changed."""
    if module.tied is None:  # untied since (lmlab.nn.quant: the head quantized on its own)
        return
    head, embedding = module.tied
    loaded = module._tie_loaded
    if loaded:
        module._retie(embedding if embedding in loaded else head)
    module._tie_loaded = set()
