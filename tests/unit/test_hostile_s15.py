"""Hostile-input checks of session 15's features (fused q/k/v cache, RoPE memo)."""

from __future__ import annotations

import pytest
import torch

import lmlab.nn.fused as fused
from lmlab.models.build import build_model
from tests.helpers import tiny_model_config


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if torch.is_tensor(out) else out.logits


def _unfused(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    on = fused.ENABLED
    fused.ENABLED = False
    try:
        return _logits(model, ids)
    finally:
        fused.ENABLED = on


def test_inference_mode_forward_and_in_place_edit_match_unfused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torch.inference_mode the positions (and a model built there, its parameters) are
    inference tensors without a version counter: the forward ran into RuntimeError in the RoPE
    memo; the fused cache must not watch them either (an in-place edit stays visible)."""
    monkeypatch.setattr(fused, "ENABLED", True)  # on by default; on here whatever a caller set
    torch.manual_seed(0)
    cfg = tiny_model_config()
    ids = torch.randint(0, 50, (1, 7))
    model = build_model(cfg).eval()
    with torch.inference_mode():
        a = _logits(model, ids)
        b = _unfused(model, ids)
        assert torch.allclose(a, b, atol=1e-6)
        built = build_model(cfg).eval()
        _logits(built, ids)
        built.layers[0].attn.q_proj.weight.mul_(2)
        a, b = _logits(built, ids), _unfused(built, ids)
        assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():  # a model run under inference_mode, then edited under no_grad
        model.layers[0].attn.k_proj.weight.add_(0.5)
        assert torch.allclose(_logits(model, ids), _unfused(model, ids), atol=1e-6)
