"""NSA (Yuan et al. 2025): the facts only it has.

- the module equals a float64 dense reference written here from the paper's equations (each
  branch as a masked softmax over all real keys, the selection by loops over blocks), 1e-10,
  with MHA, GQA, MQA, QK-norm and left padding (positions from the mask); 1e-5 in float32;
- with top-k covering every block and window >= T the selected and sliding branches are full
  causal attention;
- cached decoding (token by token, chunked prefill) equals the full pass, with padding;
- gradients reach every parameter;
- the selected and sliding branches' score tensors hold n l' and w keys per query, not S, and the
  declared score FLOPs fall with sparsity;
- each bad field is one ConfigError naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.errors import ConfigError, LmlabError
from lmlab.nn import nsa
from lmlab.nn.attention import ATTENTION
from lmlab.nn.attention_core import attention_math
from lmlab.nn.masks import position_ids_from_attention_mask
from lmlab.nn.position import POSITION
from tests.helpers.attention_maps import forward_with_map
from tests.helpers.cli import assert_one_error, run_cli
from tests.helpers.configs import tiny_model_config

SMALL = {"compress_block": 4, "compress_stride": 2, "select_block": 4, "select_top_k": 2}


def nsa_cfg(**attention):
    return tiny_model_config(attention={"n_heads": 4, "kind": "nsa", **SMALL, **attention})


def build(dtype=torch.float64, seed=0, std=0.5, **attention):
    cfg = nsa_cfg(**attention)
    torch.manual_seed(seed)
    m = ATTENTION.get("nsa")(cfg).to(dtype).eval()
    pos = POSITION.get(cfg.position.kind)(cfg).to(dtype)
    with torch.no_grad():  # larger weights than the init: sharper, more varied selections
        for p in m.parameters():
            p.normal_(0.0, std)
    return cfg, m, pos


def padded_batch(cfg, t=20, pad=(0, 5), dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(pad), t, cfg.d_model, generator=g, dtype=dtype)
    key_mask = torch.ones(len(pad), t, dtype=torch.bool)
    for b, n in enumerate(pad):
        key_mask[b, :n] = False
    return x, key_mask, position_ids_from_attention_mask(key_mask)


# ----------------------------------------------------------------------------- the oracle


def softmax_masked(scores, mask):
    w = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return w.nan_to_num(0.0)


def reference(m, pos, x, positions, key_mask):
    """The paper's eq. 5-11 for one layer, in loops and dense masks: (B, T, D)."""
    b_, t_, _ = x.shape
    h_, kv_, hd = m.n_heads, m.n_kv_heads, m.head_dim
    l, d, ls, n_top, w = m.block, m.stride, m.select_block, m.top_k, m.nsa_window

    def heads(proj, n):
        return proj(x).view(b_, t_, n, hd).transpose(1, 2)

    q = m.q_norm(m.q_proj(x).view(b_, t_, h_, hd)).transpose(1, 2)
    k = m.k_norm(heads(m.k_proj, kv_).transpose(1, 2)).transpose(1, 2)
    kw = m.k_norm(heads(m.window_k_proj, kv_).transpose(1, 2)).transpose(1, 2)
    v = m.v_norm(heads(m.v_proj, kv_).transpose(1, 2)).transpose(1, 2)
    vw = m.v_norm(heads(m.window_v_proj, kv_).transpose(1, 2)).transpose(1, 2)
    q, k = pos.rotate(q, k, positions)
    _, kw = pos.rotate(q, kw, positions)
    gates = torch.sigmoid(m.gate_proj(x)).view(b_, t_, 3, h_)
    y = torch.zeros(b_, t_, h_, hd, dtype=x.dtype)
    for b in range(b_):
        real = [j for j in range(t_) if key_mask[b, j]]
        n = len(real)
        kr, vr, kwr, vwr = (z[b][:, real] for z in (k, v, kw, vw))  # (K, n, hd)
        nc = (n - l) // d + 1 if n >= l else 0
        kcmp = [m.compress_k(kr[:, c * d : c * d + l].reshape(kv_, l * hd)) for c in range(nc)]
        vcmp = [m.compress_v(vr[:, c * d : c * d + l].reshape(kv_, l * hd)) for c in range(nc)]
        for t in range(t_):
            i = sum(1 for j in real if j <= t) - 1  # the query's real-token index
            if i < 0:
                continue
            keys = torch.arange(n)
            causal = keys <= i
            p_cmp = torch.zeros(h_, max(nc, 1), dtype=x.dtype)
            for h in range(h_):
                g = h // (h_ // kv_)
                qh = q[b, h, t] * m.scale
                o_cmp = torch.zeros(hd, dtype=x.dtype)
                if nc:
                    kc = torch.stack([c[g] for c in kcmp])
                    vc = torch.stack([c[g] for c in vcmp])
                    vis = torch.tensor([c * d + l - 1 <= i for c in range(nc)])
                    p_cmp[h] = softmax_masked(kc @ qh, vis)
                    o_cmp = p_cmp[h] @ vc
                y[b, t, h] += gates[b, t, 0, h] * o_cmp
                win = causal & (keys > i - w)
                y[b, t, h] += gates[b, t, 2, h] * (softmax_masked(kwr[g] @ qh, win) @ vwr[g])
            for g in range(kv_):  # the group's shared selection
                heads_g = range(g * (h_ // kv_), (g + 1) * (h_ // kv_))
                imp = sum(p_cmp[h] for h in heads_g)
                own = i // ls
                scores = {}
                for j in range(own + 1):
                    share = [
                        max(0, min(c * d + l, (j + 1) * ls) - max(c * d, j * ls)) for c in range(nc)
                    ]
                    scores[j] = sum(float(imp[c]) * share[c] for c in range(nc))
                ranked = (
                    [own]
                    + ([0] if own else [])
                    + sorted((j for j in scores if j not in (0, own)), key=lambda j: -scores[j])
                )
                chosen = set(ranked[:n_top])
                sel = causal & torch.tensor([j // ls in chosen for j in range(n)])
                for h in heads_g:
                    p = softmax_masked(kr[g] @ (q[b, h, t] * m.scale), sel)
                    y[b, t, h] += gates[b, t, 1, h] * (p @ vr[g])
    return m.o_proj(y.reshape(b_, t_, h_ * hd))


CASES = [
    {},
    {"n_kv_heads": 2},
    {"n_kv_heads": 1, "nsa_window": 3, "select_top_k": 3},
    {"compress_block": 2, "compress_stride": 2, "select_block": 6, "select_top_k": 1},
    {"compress_block": 4, "compress_stride": 4, "select_block": 8, "qk_norm": True},
    {"compress_block": 3, "compress_stride": 1, "select_block": 3, "nsa_window": 1},
]


@pytest.mark.parametrize("attention", CASES)
def test_module_equals_dense_reference_float64(attention):
    cfg, m, pos = build(**attention)
    x, key_mask, positions = padded_batch(cfg)
    with torch.no_grad():
        out = m(x, pos, positions, key_mask).out
        ref = reference(m, pos, x, positions, key_mask)
    real = key_mask[:, :, None]
    assert (out - ref).abs().mul(real).max() < 1e-10
    assert ref.abs().mul(real).max() > 0.1  # not a zero output


def test_module_equals_reference_float32():
    for attention in CASES[:3]:
        cfg, m, pos = build(dtype=torch.float32, std=0.2, **attention)
        x, key_mask, positions = padded_batch(cfg, dtype=torch.float32)
        m64 = ATTENTION.get("nsa")(cfg).double().eval()
        m64.load_state_dict({k: t.double() for k, t in m.state_dict().items()})
        with torch.no_grad():
            out = m(x, pos, positions, key_mask).out.double()
            ref = reference(m64, pos.double(), x.double(), positions, key_mask)
        assert (out - ref).abs().mul(key_mask[:, :, None]).max() < 1e-5
        assert ref.abs().max() > 0.1


def test_selection_is_data_dependent():
    """With top-k below the block count different queries (and groups) pick different blocks,
    so the reference equality above exercises the ranking, not a fixed pattern."""
    cfg, m, pos = build(n_kv_heads=2, select_top_k=3)
    x, key_mask, positions = padded_batch(cfg, t=24, pad=(0, 0))
    q, k, _, v, _ = m.project_all(x, pos, positions)
    _, qi = nsa.token_index(None, 24, 24, x.device)
    kcmp = nsa.compress(k, m.compress_k, m.block, m.stride)
    vcmp = nsa.compress(v, m.compress_v, m.block, m.stride)
    _, p = nsa.compressed_attention(q, kcmp, vcmp, qi, m.block, m.stride, m.scale)
    blocks, valid = nsa.select_blocks(p, qi, 24, m.block, m.stride, m.select_block, m.top_k)
    # the score-ranked slot differs across rows, groups and queries
    assert blocks[:, :, 12:, 2].unique().numel() > 1
    assert blocks[..., 0].eq(qi[:, None] // 4).all()  # the own block first
    assert valid[:, :, 8:].all()  # from the third block on, three candidates exist


def test_full_coverage_branches_are_causal_attention():
    """select_top_k >= the block count and nsa_window >= T: the selected and sliding branches
    are ordinary causal softmax attention over their keys (1e-12)."""
    cfg, m, pos = build(select_top_k=8, nsa_window=32, n_kv_heads=2)
    x, _, positions = padded_batch(cfg, t=18, pad=(0, 0))
    with torch.no_grad():
        q, k, kw, v, vw = m.project_all(x, pos, positions)
        _, o_slc, o_win = m.branches(q, k, v, kw, vw, None)
        causal = torch.ones(18, 18, dtype=torch.bool).tril()
        full, _ = attention_math(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal, m.scale
        )
        win, _ = attention_math(
            q, kw.repeat_interleave(2, 1), vw.repeat_interleave(2, 1), causal, m.scale
        )
    assert (o_slc - full).abs().max() < 1e-12
    assert (o_win - win).abs().max() < 1e-12


@pytest.mark.parametrize("steps", [[8, 1, 1, 1, 1, 1, 1], [5, 3, 4, 1, 2, 1]])
def test_cached_decoding_equals_full_pass(steps):
    cfg, m, pos = build(n_kv_heads=2, nsa_window=3)
    x, key_mask, positions = padded_batch(cfg, t=sum(steps), pad=(0, 3))
    with torch.no_grad():
        full = m(x, pos, positions, key_mask).out
        cache, outs, start = m.new_cache(), [], 0
        for n in steps:
            sl = slice(start, start + n)
            outs.append(m(x[:, sl], pos, positions[:, sl], key_mask[:, : start + n], cache).out)
            start += n
    diff = (torch.cat(outs, 1) - full).abs().mul(key_mask[:, :, None]).max()
    assert diff < 1e-10
    assert cache.raw.seq_len == sum(steps) and cache.window.kept == 2  # w - 1 sliding keys


def test_gradients_reach_every_parameter():
    cfg, m, pos = build(dtype=torch.float32, n_kv_heads=2)
    m.train()
    x, key_mask, positions = padded_batch(cfg, dtype=torch.float32)
    m(x, pos, positions, key_mask).out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
        assert p.grad.abs().sum() > 0, name


def test_gathered_branches_score_only_their_keys(monkeypatch):
    """The score tensors' last dims are Nc, n l' and w, not S (T = S = 64 here)."""
    cfg, m, pos = build(compress_block=8, compress_stride=4, select_block=8, nsa_window=8)
    x, _, positions = padded_batch(cfg, t=32, pad=(0,))
    shapes = []
    real = nsa.softmax_probs

    def spy(scores, seen, dtype):
        shapes.append(scores.shape[-1])
        return real(scores, seen, dtype)

    monkeypatch.setattr(nsa, "softmax_probs", spy)
    with torch.no_grad():
        m(x, pos, positions)
    assert shapes == [7, 2 * 8, 8]  # Nc = (32 - 8) // 4 + 1, n l', w
    dense = ATTENTION.get("softmax").score_flops_per_token(cfg, 512)
    sparse = type(m).score_flops_per_token(cfg, 512)
    assert sparse < dense / 3


def test_need_weights_refused():
    cfg, m, pos = build()
    x, _, positions = padded_batch(cfg, t=6, pad=(0,))
    with pytest.raises(LmlabError, match="nsa has no single attention map"):
        forward_with_map(m, x, pos, positions)


@pytest.mark.parametrize(
    "attention, field",
    [
        ({"select_block": 5}, "select_block"),  # not a multiple of compress_stride 2
        ({"select_block": 2, "compress_block": 4}, "select_block"),  # < compress_block
        ({"select_top_k": 0}, "select_top_k"),
        ({"select_top_k": 9}, "select_top_k"),  # > ceil(32 / select_block 4) = 8 blocks
        ({"select_top_k": 10**23}, "select_top_k"),
        ({"nsa_window": 0}, "nsa_window"),
        ({"nsa_window": 33}, "nsa_window"),  # > max_seq_len 32
        ({"compress_block": 40, "select_block": 40}, "compress_block"),
        ({"compress_stride": 0}, "compress_stride"),
        ({"compress_stride": 6, "select_block": 6}, "compress_stride"),  # > compress_block 4
        ({"mask": "sliding_window", "window": 4}, "mask"),
    ],
)
def test_config_errors_name_the_field(attention, field):
    with pytest.raises(ConfigError, match=f"model.attention.{field}"):
        nsa_cfg(**attention)


def test_select_top_k_may_reach_every_block_of_the_context():
    """n = ceil(max_seq_len / l') (every selection block, the last partial one included) is
    accepted; one more is refused (the bound of the check)."""
    nsa_cfg(select_top_k=8)  # 32 / 4
    nsa_cfg(select_top_k=3, select_block=12, compress_block=4)  # ceil(32 / 12) = 3
    with pytest.raises(ConfigError, match=r"select_top_k must be in \[1, 3\]"):
        nsa_cfg(select_top_k=4, select_block=12, compress_block=4)


def test_score_bias_position_refused():
    with pytest.raises(ConfigError, match="model.position.kind=alibi"):
        tiny_model_config(attention={"kind": "nsa"}, position={"kind": "alibi"})


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.attention.select_block=12", "model.attention.select_block"),  # 12 % 8
        ("model.attention.select_top_k=0", "model.attention.select_top_k"),
        ("model.attention.nsa_window=300", "model.attention.nsa_window"),  # > 256
        ("model.attention.compress_block=512", "model.attention.compress_block"),
    ],
)
def test_cli_refuses_bad_field_in_one_line(capsys, override, needle):
    code, _, err = run_cli(capsys, "inspect", "configs/nsa.yaml", "--set", override)
    assert_one_error(code, err, needle)


def test_nsa_fields_refused_on_other_kinds(capsys):
    code, _, err = run_cli(
        capsys, "inspect", "configs/tiny.yaml", "--set", "model.attention.select_top_k=5"
    )
    assert_one_error(code, err, "select_top_k")


def test_preset_declares_its_kv_cache_and_sparsity():
    """configs/nsa.yaml: (context + window) raw and sliding keys per layer, and at 512 tokens
    fewer than a third of dense attention's score FLOPs (63 + 64 + 32 keys a query, not 512)."""
    from lmlab.analysis.costs import kv_cache_bytes
    from lmlab.config import load_config

    cfg = load_config(Path("configs/nsa.yaml")).model
    cfg.vocab_size = 256
    per_layer = 2 * 2 * 16 * 4  # 2 K hd float32
    assert kv_cache_bytes(cfg, 1, 256) == 2 * (256 + 32) * per_layer
    nsa_cls, dense = ATTENTION.get("nsa"), ATTENTION.get("softmax")
    assert nsa_cls.key_counts(cfg, 512) == (63, 32, 64, 32)
    assert nsa_cls.score_flops_per_token(cfg, 512) < dense.score_flops_per_token(cfg, 512) / 3
