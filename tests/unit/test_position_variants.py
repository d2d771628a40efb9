"""ALiBi, RoPE layouts (half-split / interleaved, partial rotary) and RoPE context scaling, each
checked against the paper's formula written out here in float64."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import RopeScalingConfig
from lmlab.errors import ConfigError
from lmlab.models import build_model
from lmlab.nn.position import ALiBiPosition, RotaryPosition, alibi_slopes
from lmlab.nn.rope_scaling import (
    ROPE_SCALING,
    dynamic_ntk_scaling,
    ntk_scaling,
    rope_inv_freq,
    yarn_scaling,
)
from tests.helpers import tiny_model_config

# ----------------------------------------------------------------------------- ALiBi


def paper_slopes(n: int) -> list[float]:
    """Press et al. 2022's reference code (float64): geometric from 2^(-8/n) for n a power of two,
    else the closest power of two's slopes + every other slope of twice that, recursively."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_for_8_heads_are_exactly_2_to_minus_1_to_minus_8():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 7, 12, 16, 20, 24])
def test_alibi_slopes_for_any_head_count_equal_the_papers_procedure(n_heads: int):
    ref = torch.tensor(paper_slopes(n_heads), dtype=torch.float64)
    got = alibi_slopes(n_heads)
    assert got.dtype == torch.float32 and got.shape == (n_heads,)
    torch.testing.assert_close(got.double(), ref, atol=0, rtol=1e-7)


def test_alibi_slopes_for_6_and_12_heads_by_hand():
    # 6 heads: 4's slopes 2^-2, 2^-4, 2^-6, 2^-8, then 8's 1st and 3rd: 2^-1, 2^-3.
    assert alibi_slopes(6).tolist() == [2.0**-e for e in (2, 4, 6, 8, 1, 3)]
    # 12 heads: 8's slopes 2^-1..2^-8, then 16's odd-indexed: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
    ref = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    torch.testing.assert_close(alibi_slopes(12).double(), torch.tensor(ref, dtype=torch.float64))


def test_alibi_bias_is_minus_slope_times_distance_at_absolute_query_positions():
    cfg = tiny_model_config(attention={"n_heads": 6, "head_dim": 8}, position={"kind": "alibi"})
    alibi = ALiBiPosition(cfg)
    positions = torch.tensor([5, 6, 7])  # three new queries after a 5-token cache
    bias = alibi.score_bias(positions, 8)
    assert bias.shape == (6, 3, 8) and bias.dtype == torch.float32
    slopes = paper_slopes(6)
    for h in range(6):
        for t, i in enumerate(positions.tolist()):
            for j in range(i + 1):  # keys at or before the query
                assert float(bias[h, t, j]) == pytest.approx(-slopes[h] * (i - j), rel=1e-6)


def test_alibi_scores_reach_attention_with_zero_queries_the_weights_are_softmax_of_the_bias():
    cfg = tiny_model_config(vocab_size=37, position={"kind": "alibi"})
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.zero_()  # scores = 0 + bias
        out = model(torch.randint(0, 37, (1, 6)), need_weights=True)
    slopes = torch.tensor(paper_slopes(4), dtype=torch.float64)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    scores = -slopes[:, None, None] * (i - j).double()
    ref = torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)
    torch.testing.assert_close(out.attentions[0][0].double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_alibi_sdpa_and_math_backends_agree_full_and_cached(n_kv_heads: int):
    attention = {"n_heads": 4, "n_kv_heads": n_kv_heads}
    sdpa = build_model(tiny_model_config(37, position={"kind": "alibi"}, attention=attention))
    math_attention = {**attention, "backend": "math"}
    ref = build_model(tiny_model_config(37, position={"kind": "alibi"}, attention=math_attention))
    ref.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 37, (2, 11))
    with torch.no_grad():
        full = ref.eval()(x).logits
        torch.testing.assert_close(sdpa.eval()(x).logits, full, atol=1e-5, rtol=1e-5)
        cache = sdpa.new_cache()
        steps = [sdpa(x[:, :4], cache=cache).logits]
        steps += [sdpa(x[:, t : t + 3], cache=cache).logits for t in (4, 7)]  # 3-token chunks
        steps.append(sdpa(x[:, 10:], cache=cache).logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- RoPE layouts


def rope(interleaved: bool = False, partial: float = 1.0, scaling: dict | None = None, **kw):
    position = {"interleaved": interleaved, "partial_rotary_factor": partial}
    position["scaling"] = scaling or {}
    return RotaryPosition(tiny_model_config(position=position, **kw))


def half_to_interleaved(hd: int, r: int) -> torch.Tensor:
    """Channel order taking half-split pairs (i, i + r/2) to interleaved pairs (2i, 2i + 1); the
    hd - r pass-through channels stay in place."""
    perm = torch.arange(hd)
    perm[0:r:2] = torch.arange(r // 2)
    perm[1:r:2] = torch.arange(r // 2) + r // 2
    return perm


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_interleaved_model_equals_half_split_model_with_permuted_qk_rows(partial: float):
    def make(interleaved: bool) -> torch.nn.Module:
        position = {"interleaved": interleaved, "partial_rotary_factor": partial}
        cfg = tiny_model_config(37, position=position, attention={"n_heads": 2, "n_kv_heads": 1})
        return build_model(cfg).eval()

    half, inter = make(False), make(True)
    with torch.no_grad():  # sharpen attention so positions move the logits visibly
        for layer in half.layers:
            layer.attn.q_proj.weight.mul_(20)
            layer.attn.k_proj.weight.mul_(20)
    hd = half.cfg.head_dim
    r = half.position.rotary_dim
    assert r == int(hd * partial)
    perm = half_to_interleaved(hd, r)
    x = torch.randint(0, 37, (2, 13))

    def load(order: torch.Tensor) -> torch.Tensor:
        sd = half.state_dict()
        for key in list(sd):
            if key.endswith(("attn.q_proj.weight", "attn.k_proj.weight")):
                w = sd[key]
                sd[key] = w.view(-1, hd, w.shape[-1])[:, order].reshape(w.shape)
        inter.load_state_dict(sd)
        with torch.no_grad():
            return inter(x).logits

    with torch.no_grad():
        ref = half(x).logits
    torch.testing.assert_close(load(perm), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(load(torch.arange(hd)), ref, atol=1e-3)  # unpermuted differs
    wrong = perm.clone()
    wrong[[0, 1]] = wrong[[1, 0]]  # swap one pair's members: a wrong permutation fails too
    assert not torch.allclose(load(wrong), ref, atol=1e-3)


def test_interleaved_rotation_pairs_adjacent_channels():
    p = rope(interleaved=True)
    e = torch.zeros(p.head_dim)
    e[2] = 1.0  # pair 1 = channels (2, 3), frequency theta^(-2/hd)
    rotated, _ = p.rotate(e.view(1, 1, 1, -1), e.view(1, 1, 1, -1), torch.tensor([3]))
    angle = 3 * 10000.0 ** (-2 / p.head_dim)
    ref = torch.zeros(p.head_dim, dtype=torch.float64)
    ref[2], ref[3] = math.cos(angle), math.sin(angle)
    torch.testing.assert_close(rotated.flatten().double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_leaves_the_unrotated_channels_unchanged(interleaved: bool):
    p = rope(interleaved, partial=0.25, attention={"n_heads": 2})  # hd 16, r 4
    assert (p.head_dim, p.rotary_dim) == (16, 4)
    q, k = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    qr, kr = p.rotate(q, k, torch.arange(3, 10))
    torch.testing.assert_close(qr[..., 4:], q[..., 4:], atol=0, rtol=0)
    torch.testing.assert_close(kr[..., 4:], k[..., 4:], atol=0, rtol=0)
    # The rotated block is full RoPE of width 4 with the frequencies of a 4-dim head.
    full4 = rope(interleaved, attention={"n_heads": 8})  # hd 4
    qf, _ = full4.rotate(q[..., :4], k[..., :4], torch.arange(3, 10))
    torch.testing.assert_close(qr[..., :4], qf)
    assert not torch.allclose(qr[..., :4], q[..., :4])


LAYOUTS = [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.5)]
SCALINGS = [
    {},
    {"kind": "linear", "factor": 4.0},
    {"kind": "ntk", "factor": 4.0},
    {"kind": "yarn", "factor": 4.0, "original_max_seq_len": 16},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.get("kind", "none"))
@pytest.mark.parametrize("interleaved,partial", LAYOUTS)
def test_rope_score_depends_only_on_the_offset_in_every_layout(interleaved, partial, scaling):
    p = rope(interleaved, partial, scaling, attention={"n_heads": 2})
    q, k = torch.randn(1, 1, 1, p.head_dim), torch.randn(1, 1, 1, p.head_dim)

    def score(m: int, n: int) -> float:
        qm, _ = p.rotate(q, q, torch.tensor([m]))
        _, kn = p.rotate(k, k, torch.tensor([n]))
        return float((qm * kn).sum())

    for offset in (0, 1, 5, 17):
        ref = score(offset, 0)
        for base in (3, 40, 200):
            assert score(base + offset, base) == pytest.approx(ref, abs=1e-4)
    assert score(7, 0) != pytest.approx(score(3, 0), abs=1e-3)


# ----------------------------------------------------------------------------- scaling


def ref_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def test_linear_scaling_is_position_interpolation():
    plain, scaled = rope(), rope(scaling={"kind": "linear", "factor": 4.0})
    positions = torch.arange(0, 64)
    for a, b in zip(scaled.cos_sin(positions), plain.cos_sin(positions / 4.0), strict=True):
        torch.testing.assert_close(a, b)  # position m reads as m / 4


def test_ntk_base_change_keeps_the_highest_and_divides_the_lowest_frequency_by_factor():
    dim, theta, s = 16, 10000.0, 8.0
    inv, factor = ntk_scaling(dim, theta, RopeScalingConfig(kind="ntk", factor=s))
    ref = ref_inv_freq(dim, theta * s ** (dim / (dim - 2)))
    torch.testing.assert_close(inv.double(), ref, atol=0, rtol=1e-6)
    plain = ref_inv_freq(dim, theta)
    assert float(inv[0]) == 1.0 and factor == 1.0
    assert float(inv[-1]) == pytest.approx(float(plain[-1]) / s, rel=1e-6)


def test_dynamic_ntk_is_plain_within_the_original_length_and_rescales_past_it():
    dim, theta = 16, 500.0
    s = RopeScalingConfig(kind="dynamic_ntk", factor=2.0, original_max_seq_len=32)
    plain = rope_inv_freq(dim, theta)
    for n in (1, 31, 32):
        inv, _ = dynamic_ntk_scaling(dim, theta, s, torch.tensor(n))
        torch.testing.assert_close(inv, plain, atol=0, rtol=0)
    for n in (33, 80):
        inv, _ = dynamic_ntk_scaling(dim, theta, s, torch.tensor(n))
        base = theta * (2.0 * n / 32 - 1.0) ** (dim / (dim - 2))
        torch.testing.assert_close(inv.double(), ref_inv_freq(dim, base), atol=0, rtol=1e-5)


def test_dynamic_ntk_reads_the_length_of_the_current_forward():
    cfg = {"kind": "dynamic_ntk", "factor": 2.0, "original_max_seq_len": 8}
    p = rope(scaling=cfg)
    short = p.cos_sin(torch.arange(8))[0]
    long_ = p.cos_sin(torch.arange(20))[0]
    torch.testing.assert_close(short, rope().cos_sin(torch.arange(8))[0])
    assert not torch.allclose(long_[:8], short)  # the base follows max position + 1 = 20


def yarn_reference(dim: int, theta: float, s: float, original: int, fast: float, slow: float):
    """YaRN's NTK-by-parts in float64, written from the paper's rotation counts: pair i turns
    original * theta_i / (2 pi) times over the original context; pairs turning more than
    ``fast`` times keep theta_i, fewer than ``slow`` get theta_i / s, the ramp between them is
    linear in the pair index over [floor(i_fast), ceil(i_slow)] (the reference code's form)."""

    def index_for(turns: float) -> float:  # solves original * theta^(-2i/dim) / 2pi = turns
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(index_for(fast)), 0)
    high = min(math.ceil(index_for(slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        freq = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(freq * (1 - ramp) + freq / s * ramp)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dim,theta,s,original", [(64, 10000.0, 4.0, 2048), (32, 500.0, 8.0, 1024)])
def test_yarn_frequencies_equal_the_papers_ntk_by_parts(dim, theta, s, original):
    cfg = RopeScalingConfig(kind="yarn", factor=s, original_max_seq_len=original)
    inv, attention_factor = yarn_scaling(dim, theta, cfg)
    ref = yarn_reference(dim, theta, s, original, 32.0, 1.0)
    torch.testing.assert_close(inv.double(), ref, atol=0, rtol=1e-6)
    assert attention_factor == pytest.approx(0.1 * math.log(s) + 1)  # sqrt(1/t)
    turns = original * ref_inv_freq(dim, theta) / (2 * math.pi)
    plain = ref_inv_freq(dim, theta)
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any()
    torch.testing.assert_close(inv.double()[fast], plain[fast], atol=0, rtol=1e-6)
    torch.testing.assert_close(inv.double()[slow], plain[slow] / s, atol=0, rtol=1e-6)


def test_yarn_attention_temperature_scales_cos_and_sin():
    p = rope(scaling={"kind": "yarn", "factor": 16.0, "original_max_seq_len": 16})
    cos, sin = p.cos_sin(torch.arange(10))
    mscale = 0.1 * math.log(16.0) + 1
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, mscale**2))
    q = torch.randn(1, 1, 1, p.head_dim)
    qr, kr = p.rotate(q, q, torch.tensor([0]))
    # at equal positions the score is q.q times 1/t = mscale^2 (the paper's temperature)
    assert float((qr * kr).sum()) == pytest.approx(float((q * q).sum()) * mscale**2, rel=1e-5)
    explicit = {"kind": "yarn", "factor": 16.0, "original_max_seq_len": 16}
    assert rope(scaling={**explicit, "attention_factor": 1.5}).attention_factor == 1.5
    ds = rope(scaling={**explicit, "mscale": 1.0, "mscale_all_dim": 0.5}).attention_factor
    assert ds == pytest.approx((0.1 * math.log(16) + 1) / (0.05 * math.log(16) + 1))


def test_every_scaling_kind_is_registered_and_factor_one_is_plain_rope():
    assert ROPE_SCALING.names() == ["none", "linear", "ntk", "dynamic_ntk", "yarn"]
    plain = rope().cos_sin(torch.arange(50))
    for kind in ("linear", "ntk", "yarn"):
        got = rope(scaling={"kind": kind, "factor": 1.0}).cos_sin(torch.arange(50))
        torch.testing.assert_close(got, plain)
    # Dynamic NTK at factor 1 still stretches the base by length / original (as HF computes it).
    dynamic = rope(scaling={"kind": "dynamic_ntk", "factor": 1.0, "original_max_seq_len": 25})
    torch.testing.assert_close(dynamic.cos_sin(torch.arange(25)), rope().cos_sin(torch.arange(25)))
    assert not torch.allclose(dynamic.cos_sin(torch.arange(50))[0], plain[0])


# ----------------------------------------------------------------------------- validation

BAD = [
    ({"kind": "rope", "partial_rotary_factor": 0.0}, "partial_rotary_factor must be in \\(0, 1\\]"),
    ({"kind": "rope", "partial_rotary_factor": 1.5}, "partial_rotary_factor must be in \\(0, 1\\]"),
    ({"kind": "rope", "partial_rotary_factor": 0.1}, "even number \\(>= 2\\) of rotated channels"),
    ({"kind": "rope", "partial_rotary_factor": 0.375}, "int\\(8 \\* 0.375\\) = 3"),
    ({"scaling": {"kind": "yarm"}}, "scaling.kind: unknown rope_scaling kind 'yarm'.*allowed"),
    ({"scaling": {"kind": "linear", "factor": 0.5}}, "scaling.factor must be >= 1"),
    ({"scaling": {"factor": 2.0}}, "factor=2.0 has no effect with .*kind=none"),
    ({"scaling": {"kind": "linear", "factor": 2.0, "beta_fast": 8.0}}, "beta_fast=8.0 has no"),
    ({"scaling": {"kind": "ntk", "factor": 2.0, "original_max_seq_len": 8}}, "original_max_seq"),
    ({"scaling": {"kind": "yarn", "factor": 2.0, "beta_fast": 1.0}}, "beta_fast .* must exceed"),
    ({"scaling": {"kind": "yarn", "factor": 2.0, "mscale": 1.0}}, "must be set together"),
    ({"scaling": {"kind": "yarn", "factor": 2.0, "attention_factor": 0.0}}, "attention_factor"),
    ({"scaling": {"kind": "yarn", "original_max_seq_len": 0}}, "original_max_seq_len must be > 0"),
    ({"kind": "alibi", "interleaved": True}, "interleaved applies to kind=rope only"),
    ({"kind": "learned", "scaling": {"kind": "linear"}}, "scaling applies to kind=rope only"),
]


@pytest.mark.parametrize("position,match", BAD, ids=[str(p) for p, _ in BAD])
def test_bad_position_settings_fail_naming_the_field(position: dict, match: str):
    with pytest.raises(ConfigError, match=match or "model.position"):
        tiny_model_config(position=position)


def test_ntk_needs_more_than_two_rotated_channels():
    with pytest.raises(ConfigError, match="kind=ntk needs more than 2 rotated channels"):
        tiny_model_config(position={"partial_rotary_factor": 0.25, "scaling": {"kind": "ntk"}})
    # head_dim 8 * 0.25 = 2 channels: fine for plain RoPE
    assert tiny_model_config(position={"partial_rotary_factor": 0.25}).position.kind == "rope"
