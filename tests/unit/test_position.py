import math

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.nn.position import (
    LearnedPosition,
    RotaryPosition,
    apply_rope,
    rope_inv_freq,
    sinusoidal_table,
)
from tests.helpers import tiny_model_config


def test_rope_score_depends_only_on_offset():
    cfg = tiny_model_config(d_model=32, attention={"n_heads": 2})
    rope = RotaryPosition(cfg)
    q = torch.randn(1, 1, 1, cfg.head_dim)
    k = torch.randn(1, 1, 1, cfg.head_dim)

    def score(m: int, n: int) -> float:
        qm, _ = rope.rotate(q, q, torch.tensor([m]))
        _, kn = rope.rotate(k, k, torch.tensor([n]))
        return float((qm * kn).sum())

    for offset in (0, 1, 5, 17):
        ref = score(offset, 0)
        for base in (3, 40, 200):
            assert score(base + offset, base) == pytest.approx(ref, abs=1e-4)
    assert score(7, 0) != pytest.approx(score(3, 0), abs=1e-3)


def test_rope_preserves_norm_and_position_zero_is_identity():
    cfg = tiny_model_config()
    rope = RotaryPosition(cfg)
    x = torch.randn(2, 4, 6, cfg.head_dim)
    qr, kr = rope.rotate(x, x, torch.arange(6))
    torch.testing.assert_close(qr.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(qr[:, :, 0], x[:, :, 0])
    # Position 1 rotates channel pair (0, hd/2) by exactly 1 radian (frequency theta^0 = 1).
    e = torch.zeros(cfg.head_dim)
    e[0] = 1.0
    r = apply_rope(e[None], *[t[1:2] for t in rope.cos_sin(torch.arange(2))])[0]
    assert r[0] == pytest.approx(math.cos(1.0), abs=1e-6)
    assert r[cfg.head_dim // 2] == pytest.approx(math.sin(1.0), abs=1e-6)


def test_rope_frequencies_follow_theta():
    f = rope_inv_freq(8, 10000.0)
    assert f.tolist() == pytest.approx(
        [1.0, 10000 ** (-2 / 8), 10000 ** (-4 / 8), 10000 ** (-6 / 8)]
    )


def test_sinusoidal_table_formula():
    t = sinusoidal_table(torch.arange(5), 6)
    for pos in range(5):
        for i in range(3):
            angle = pos / 10000 ** (2 * i / 6)
            assert t[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert t[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def test_learned_positions_refuse_past_the_table():
    cfg = tiny_model_config(max_seq_len=8, position={"kind": "learned"})
    pos = LearnedPosition(cfg)
    x = torch.zeros(1, 8, cfg.d_model)
    assert pos.embed(x, torch.arange(8)).shape == x.shape
    with pytest.raises(LmlabError, match="position 8 is past model.max_seq_len=8"):
        pos.embed(torch.zeros(1, 1, cfg.d_model), torch.tensor([8]))
