"""Weight initialisation schemes, chosen by ``model.init``.

Each scheme is a function (model, cfg) -> None that initialises every nn.Linear and nn.Embedding
in place; norms keep their (1, 0) defaults. Modules flagged ``is_residual_proj`` (attention o_proj,
FFN down_proj: the projections that write into the residual stream) may be scaled down so the
residual stream's variance does not grow with depth. ``model.init_zero_residual: true`` then
sets those projections to zero (:func:`init_weights`), whatever the scheme.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lmlab.config import ModelConfig
from lmlab.registry import Registry

InitFn = Callable[[nn.Module, ModelConfig], None]
INIT: Registry[InitFn] = Registry("init", "model.init")
INIT.notes = """
`model.init_std` defaults to 0.02, so `gpt2` is N(0, 0.02) with residual projections scaled by
1/sqrt(2 L), and `normal` is N(0, 0.02) everywhere. When to use: `gpt2` is the default; `normal`
for shallow models and ablations; `small` for wide models. `model.init_zero_residual: true`
(with any scheme) then zeroes the residual projections, attention o_proj and FFN down_proj, so
every pre-norm block starts as the identity (modded-nanogpt's zero-init projections; as Fixup,
Zhang et al. 2019, and ReZero, Bachlechner et al. 2020, start the residual branches at zero); a
block that normalises after the add (post-norm, hybrid) starts as its norms of the input.
"""


def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Initialise ``model`` with the scheme ``cfg.init`` names; then, when
    ``cfg.init_zero_residual``, set every residual projection (a module flagged
    ``is_residual_proj``: attention o_proj, FFN down_proj, each MoE expert's down_proj) to zero,
    weight and bias. Each block's branches then add nothing at step 0 (a pre-norm block is the
    identity; a post-norm or hybrid block is its norms of the input); the gradient still
    reaches those projections (it is the branch input times the output gradient), so they
    learn from the first step. Needs the skip connections (``model.block.residual``)."""
    INIT.get(cfg.init, "model.init")(model, cfg)
    if not cfg.init_zero_residual:
        return
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and getattr(module, "is_residual_proj", False):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()


def _normal_init(model: nn.Module, std: float, residual_std: float) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            s = residual_std if getattr(module, "is_residual_proj", False) else std
            nn.init.normal_(module.weight, mean=0.0, std=s)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)


@INIT.register("gpt2")
def gpt2_init(model: nn.Module, cfg: ModelConfig) -> None:
    """N(0, init_std) weights, zero biases; residual projections N(0, init_std / sqrt(2 L))
    (Radford et al. 2019, GPT-2)."""
    _normal_init(model, cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers))


@INIT.register("normal")
def normal_init(model: nn.Module, cfg: ModelConfig) -> None:
    """N(0, init_std) everywhere, no residual scaling (BERT, Devlin et al. 2019)."""
    _normal_init(model, cfg.init_std, cfg.init_std)


@INIT.register("small")
def small_init(model: nn.Module, cfg: ModelConfig) -> None:
    """std = sqrt(2 / (5 d_model)) (Nguyen & Salazar 2019, "Transformers without Tears");
    residual projections 2 / (n_layers sqrt(d_model)) (Wang's init, as GPT-NeoX uses)."""
    std = math.sqrt(2.0 / (5.0 * cfg.d_model))
    _normal_init(model, std, 2.0 / cfg.n_layers / math.sqrt(cfg.d_model))
