"""model.block.residual: false removes the skip connection x + f(x) -> f(x) in every block."""

from __future__ import annotations

import pytest
import torch

from lmlab.interop.families import NotRepresentable, family_for
from lmlab.models.build import build_model
from lmlab.nn.block import BLOCK
from lmlab.nn.position import POSITION
from tests.helpers import tiny_model_config


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_without_residual_a_block_is_its_branches_composed(kind):
    cfg = tiny_model_config(block={"kind": kind, "residual": False})
    block = BLOCK.get(kind)(cfg, 0).eval()
    position = POSITION.get("rope")(cfg)
    x = torch.randn(2, 5, cfg.d_model)
    pos = torch.arange(5)
    y = block(x, position, pos)
    if kind == "pre":  # attn(norm(x)), then ffn(norm(.)): no x added
        a = block.attn(block.attn_norm(x), position, pos).out
        expected = block.ffn(block.ffn_norm(a))
    else:  # norm(attn(x)), then norm(ffn(.))
        a = block.attn_norm(block.attn(x, position, pos).out)
        expected = block.ffn_norm(block.ffn(a))
    torch.testing.assert_close(y, expected)
    with_res = BLOCK.get(kind)(tiny_model_config(block={"kind": kind}), 0).eval()
    with_res.load_state_dict(block.state_dict())
    assert not torch.allclose(with_res(x, position, pos)[0], y)


def test_residual_default_is_on_and_has_no_hf_counterpart_when_off():
    assert tiny_model_config().block.residual is True
    cfg = tiny_model_config(block={"residual": False})
    assert build_model(cfg).num_params() == build_model(tiny_model_config()).num_params()
    with pytest.raises(NotRepresentable, match="model.block.residual=false"):
        family_for("gpt_neox").from_config(cfg)
