"""Speedrun components: the squared-ReLU activation (``model.ffn.activation: relu2``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.cli import main
from lmlab.nn.ffn import ACTIVATIONS, MLP, relu2
from tests.helpers.configs import tiny_model_config

# ----------------------------------------------------------------------------- relu2


def test_relu2_is_relu_squared_in_float64_and_its_gradient_is_twice_relu() -> None:
    x = torch.linspace(-3.0, 3.0, 601, dtype=torch.float64, requires_grad=True)
    y = relu2(x)
    assert y.dtype == torch.float64
    expected = torch.where(x > 0, x * x, torch.zeros_like(x))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(y, F.relu(x) ** 2, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 2 * F.relu(x.detach()), rtol=0, atol=0)


def test_relu2_is_registered_and_the_mlp_uses_it() -> None:
    assert ACTIVATIONS.get("relu2") is relu2
    torch.manual_seed(0)
    cfg = tiny_model_config(ffn={"activation": "relu2"})
    mlp = MLP(cfg).double()
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        expected = mlp.down_proj(F.relu(mlp.up_proj(x)) ** 2)
        torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-12)


def test_lmlab_list_names_relu2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "activation"]) == 0
    assert "relu2" in capsys.readouterr().out
