"""Precomputed position tables keep float32 precision when the model is cast to bf16/fp16/fp64.

A bf16 RoPE inverse frequency is off by up to 2^-9 relative, so at position ~4000 (and over a
4000-token query-key distance) the angle is off by radians: positions are destroyed. The tables
must stay float32; only cos/sin (or the bias) are cast to the activations' dtype.
"""

import pytest
import torch

from lmlab.models import build_model
from lmlab.nn.position import alibi_slopes, sinusoidal_table
from tests.helpers import tiny_model_config

LONG = torch.arange(4000, 4096)  # positions far past the tiny context


def _rope_model(scaling: dict | None = None):
    position = {"kind": "rope", "scaling": scaling or {"kind": "none"}}
    return build_model(tiny_model_config(position=position))


SCALINGS = [
    None,
    {"kind": "linear", "factor": 4.0},
    {"kind": "ntk", "factor": 4.0},
    {"kind": "yarn", "factor": 4.0, "original_max_seq_len": 32},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["none", "linear", "ntk", "yarn"])
def test_rope_angles_of_a_cast_model_equal_float32_at_long_range(dtype, scaling):
    model = _rope_model(scaling)
    cos32, sin32 = model.position.cos_sin(LONG)
    model.to(dtype)
    assert model.position.inv_freq.dtype == torch.float32
    cos, sin = model.position.cos_sin(LONG)
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos, cos32, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin32, rtol=0, atol=0)


def test_rope_scores_of_a_bf16_model_at_long_offsets_equal_float32_ones():
    """q.k after RoPE depends on the offset times each frequency: rounded frequencies turn a
    4000-token offset by radians (measured: up to 0.21 |q||k| off; float32 tables: 0.001)."""
    cfg = tiny_model_config(d_model=64, attention={"n_heads": 2}, position={"kind": "rope"})
    rope32, rope16 = build_model(cfg).position, build_model(cfg).to(torch.bfloat16).position

    def score(rope, q, k, m: int, n: int) -> float:
        qm, _ = rope.rotate(q, q, torch.tensor([m]))
        _, kn = rope.rotate(k, k, torch.tensor([n]))
        return float((qm.float() * kn.float()).sum())

    worst = 0.0
    for _ in range(20):
        q, k = (torch.randn(1, 1, 1, cfg.head_dim).to(torch.bfloat16) for _ in range(2))
        bound = float(q.float().norm() * k.float().norm())
        for m, n in ((1000, 0), (4000, 0), (8191, 191), (4100, 4000)):
            exact = score(rope32, q.float(), k.float(), m, n)
            worst = max(worst, abs(score(rope16, q, k, m, n) - exact) / bound)
    assert worst <= 0.02  # bf16 cos/sin and q, k: a few 2^-9 of |q||k|


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_alibi_slopes_of_a_cast_model_stay_float32(dtype):
    # 12 heads: the slopes 2^(-k/2) of the second series are not representable in bf16
    cfg = tiny_model_config(d_model=48, position={"kind": "alibi"}, attention={"n_heads": 12})
    model = build_model(cfg)
    bias32 = model.position.score_bias(LONG, 4096)
    model.to(dtype)
    assert model.position.slopes.dtype == torch.float32
    torch.testing.assert_close(model.position.slopes, alibi_slopes(12), rtol=0, atol=0)
    torch.testing.assert_close(model.position.score_bias(LONG, 4096), bias32, rtol=0, atol=0)


def test_sinusoidal_embedding_of_a_bf16_model_is_the_float32_table_cast_once():
    """A guard: the sinusoid table is computed in float32 on use, and only the sum is cast."""
    model = build_model(tiny_model_config(position={"kind": "sinusoidal"})).to(torch.bfloat16)
    x = torch.zeros(1, len(LONG), model.cfg.d_model, dtype=torch.bfloat16)
    out = model.position.embed(x, LONG)
    expected = sinusoidal_table(LONG, model.cfg.d_model).to(torch.bfloat16)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)


def test_a_model_built_on_meta_gets_its_tables_back_from_to_empty():
    """``to_empty`` allocates uninitialised buffers; the tables are recomputed, not garbage."""
    cfg = tiny_model_config(position={"kind": "rope"})
    reference = build_model(cfg).position.inv_freq
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    torch.testing.assert_close(model.position.inv_freq, reference, rtol=0, atol=0)
