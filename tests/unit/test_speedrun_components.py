"""Speedrun components: the squared-ReLU activation (``model.ffn.activation: relu2``) and
zero-initialised residual projections (``model.init_zero_residual``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.cli import main
from lmlab.errors import ConfigError
from lmlab.models.build import build_model
from lmlab.nn.ffn import ACTIVATIONS, MLP, relu2
from tests.helpers.configs import encoder_config, tiny_config, tiny_model_config

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


# ----------------------------------------------------------------------------- zero init


def _residual_names(model: torch.nn.Module) -> set[str]:
    return {
        f"{name}.{p}"
        for name, module in model.named_modules()
        if getattr(module, "is_residual_proj", False)
        for p in ("weight", "bias")
        if getattr(module, p, None) is not None
    }


@pytest.mark.parametrize("init", ["gpt2", "small"])
def test_zero_init_zeroes_the_residual_projections_and_keeps_the_base_scheme_elsewhere(
    init: str,
) -> None:
    kw = {"n_layers": 3, "init": init, "ffn": {"bias": True}, "attention": {"bias": True}}
    torch.manual_seed(3)
    base = build_model(tiny_model_config(**kw))
    torch.manual_seed(3)
    zero = build_model(tiny_model_config(init_zero_residual=True, **kw))
    names = _residual_names(zero)
    # o_proj and down_proj, weight and bias, in every layer
    assert len(names) == 3 * 4, sorted(names)
    assert all(
        n.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias"))
        for n in names
    )
    base_sd, zero_sd = base.state_dict(), zero.state_dict()
    assert base_sd.keys() == zero_sd.keys()
    for name, value in zero_sd.items():
        if name in names:
            assert not value.any(), name
            assert base_sd[name].ndim == 1 or base_sd[name].abs().sum() > 0, name
        else:  # the base scheme's draw, bit for bit (zeroing happens after it)
            assert torch.equal(value, base_sd[name]), name


def test_zero_init_blocks_start_as_the_identity_and_their_projections_still_learn() -> None:
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=37, init_zero_residual=True))
    ids = torch.randint(0, 37, (2, 7))
    out = model(ids, output_hidden_states=True)
    first, *middle, last = out.hidden_states  # the last one is after the final norm
    assert len(middle) == model.cfg.n_layers - 1
    for h in middle:  # every layer passes its input through unchanged
        torch.testing.assert_close(h, first, rtol=0, atol=0)
    torch.testing.assert_close(last, model.final_norm(first), rtol=0, atol=0)
    F.cross_entropy(out.logits.flatten(0, 1), torch.randint(0, 37, (14,))).backward()
    for layer in model.layers:
        assert layer.attn.o_proj.weight.grad.abs().sum() > 0
        assert layer.ffn.down_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["post", "hybrid"])
def test_zero_init_norm_after_the_add_blocks_start_as_their_norms_not_the_identity(kind) -> None:
    """A block that normalises after the residual add (post: norm(x + attn), norm(x + ffn);
    hybrid: x + attn, then norm(x + ffn)) starts as its norms of the input, not the identity:
    what the docs say (they said every block started as the identity)."""
    torch.manual_seed(0)
    cfg = tiny_model_config(vocab_size=37, init_zero_residual=True, block={"kind": kind})
    model = build_model(cfg)
    with torch.no_grad():  # norms away from (1, 0), so norm(x) differs from x for sure
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    out = model(torch.randint(0, 37, (2, 7)), output_hidden_states=True)
    x, h1 = out.hidden_states[0], out.hidden_states[1]
    layer = model.layers[0]
    want = layer.ffn_norm(layer.attn_norm(x)) if kind == "post" else layer.ffn_norm(x)
    torch.testing.assert_close(h1, want, rtol=0, atol=0)
    assert not torch.equal(h1, x)
    from lmlab.models.init import INIT

    assert "pre-norm block" in INIT.notes and "post-norm" in INIT.notes


def test_zero_init_zeroes_an_encoders_projections_too() -> None:
    torch.manual_seed(0)
    model = build_model(encoder_config(vocab_size=40, init_zero_residual=True))
    names = _residual_names(model)
    assert names and all(not model.get_parameter(n).any() for n in names)


def test_zero_init_needs_the_skip_connections() -> None:
    with pytest.raises(ConfigError, match="model.init_zero_residual needs model.block.residual"):
        tiny_config(model={"init_zero_residual": True, "block": {"residual": False}})


def test_verify_checks_a_zero_init_config_with_its_blocks_working() -> None:
    """lmlab verify builds random models from the config: under init_zero_residual every block
    was the identity, so causality and the KV cache passed whatever attention computed. Its
    model now has random residual projections (the scheme's, as without the flag)."""
    from lmlab.analysis import verify

    cfg = tiny_model_config(vocab_size=37, init_zero_residual=True)
    model = verify._model(cfg)
    torch.manual_seed(0)
    plain = build_model(tiny_model_config(vocab_size=37)).eval()
    for layer, ref in zip(model.layers, plain.layers, strict=True):
        assert layer.attn.o_proj.weight.abs().sum() > 0
        assert torch.equal(layer.attn.o_proj.weight, ref.attn.o_proj.weight)
    # a block that attends to the future is caught (with zeroed projections it was not)
    bad = verify._model(cfg)
    for layer in bad.layers:
        layer.attn.mask_fn = None  # every query sees every key
    ids = torch.randint(0, 37, (1, 8))
    later = ids.clone()
    later[0, 5:] = (later[0, 5:] + 1) % 37
    with torch.no_grad():
        assert not torch.equal(bad(ids).logits[0, :5], bad(later).logits[0, :5])
