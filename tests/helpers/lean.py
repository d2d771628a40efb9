"""Shared pieces of the lean decode step's tests (tests/unit/test_lean_step.py,
test_lean_step_state.py, test_decode_kernel.py): a Llama-like tiny architecture, unit-gain
weights, and a lean step set beside the forward's own cache."""

from __future__ import annotations

import math

import torch

from lmlab.generation.lean_step import LeanStep

# RMSNorm, SwiGLU without biases, RoPE, GQA 6 query / 2 key-value heads of 8 channels
LLAMA = {
    "norm": {"kind": "rmsnorm"},
    "ffn": {"kind": "swiglu", "bias": False},
    "position": {"kind": "rope"},
    "attention": {"n_heads": 6, "n_kv_heads": 2},
    "d_model": 48,
}


def unit_gain_(model: torch.nn.Module) -> torch.nn.Module:
    """Re-draw ``model``'s parameters in place with unit gain (matrices N(0, 1/fan_in), norm
    weights 1 + 0.2 N(0, 1), biases 0.2 N(0, 1)): O(1) logits and attention far from uniform,
    so greedy tokens vary and a wrong path shows. Returns ``model``."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            elif n.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def lean_beside_the_forward(model: torch.nn.Module) -> tuple[LeanStep, object]:
    """A lean step and the forward's own cache, both after the same 4-token prompt and one
    decoded token (1): the next token through each must give the same logits."""
    prompt = torch.randint(0, 40, (1, 4))
    with torch.no_grad():
        cache, ref_cache = model.new_cache(), model.new_cache()  # type: ignore[operator]
        model(prompt, cache=cache)
        model(prompt, cache=ref_cache)
        lean = LeanStep(model, cache, 16)  # type: ignore[arg-type]
        lean(torch.tensor([[1]]))
        model(torch.tensor([[1]]), cache=ref_cache)
    return lean, ref_cache
