"""MoBA (Lu et al. 2025): the facts only it has.

- with moba_top_k >= the number of blocks it is full causal attention (same weights, 1e-12);
- the selection mask equals an independent loop over queries and blocks (pooled keys, sorted
  gate scores, the own block, causality), with padding and cached keys;
- the gathered-block path equals the dense masked path (the oracle) to 1e-6, with GQA, padding,
  cached keys and an ALiBi bias, and as a module;
- no query sees a later token (weights and outputs);
- the gathered path's score tensor holds B H T min(top_k, N) bs elements, falling with sparsity,
  where the dense path's holds B H T S.
"""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.attention_core import attend, attention_math
from lmlab.nn.moba import (
    block_gate,
    compact,
    gathered_attention,
    select_blocks,
    selection_mask,
    token_index,
)
from lmlab.nn.position import POSITION, alibi_slopes
from tests.helpers.attention_maps import forward_with_map
from tests.helpers.configs import tiny_model_config


def moba_cfg(**attention):
    return tiny_model_config(attention={"n_heads": 4, "kind": "moba", **attention})


def pipeline(q, k, v, key_mask, bs, top_k):
    """The selection the module computes, from q (B, H, T, hd) and k, v (B, K, S, hd)."""
    t, s = q.shape[2], k.shape[2]
    key_index, query_index = token_index(key_mask, t, s, q.device)
    kc, vc, order = compact(k, v, key_mask)
    gate = block_gate(q, kc, query_index, bs)
    blocks, valid = select_blocks(gate, query_index, bs, top_k)
    mask = selection_mask(blocks, valid, key_index, query_index, key_mask, bs)
    return mask, (kc, vc, order, blocks, valid, query_index)


def loop_mask(q, k, key_mask, bs, top_k):
    """The paper's selection written as loops, in tensor positions (True = may attend)."""
    b_, h_, t_, _ = q.shape
    kv, s_ = k.shape[1], k.shape[2]
    real = torch.ones(b_, s_, dtype=torch.bool) if key_mask is None else key_mask
    out = torch.zeros(b_, h_, t_, s_, dtype=torch.bool)
    for b in range(b_):
        reals = [j for j in range(s_) if real[b, j]]  # tensor positions of the real tokens
        for h in range(h_):
            g = h // (h_ // kv)
            for t in range(t_):
                pos = s_ - t_ + t
                i = sum(1 for j in reals if j <= pos) - 1  # the query's real-token index
                if i < 0:
                    continue
                own = i // bs
                scores = []
                for blk in range(own):  # blocks wholly in the past
                    keys = [reals[j] for j in range(blk * bs, (blk + 1) * bs)]
                    mean = torch.stack([k[b, g, j].double() for j in keys]).mean(0)
                    scores.append((float(q[b, h, t].double() @ mean), blk))
                chosen = {blk for _, blk in sorted(scores, reverse=True)[: top_k - 1]} | {own}
                for n, j in enumerate(reals):
                    if n <= i and n // bs in chosen:
                        out[b, h, t, j] = True
    return out


def random_qkv(b=2, h=4, kv=2, t=11, s=19, hd=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, hd, generator=g, dtype=dtype)
    k = torch.randn(b, kv, s, hd, generator=g, dtype=dtype)
    v = torch.randn(b, kv, s, hd, generator=g, dtype=dtype)
    return q, k, v


def left_padding(b, s, pad):
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, :pad] = False
    return mask


CASES = [  # (kv heads, T, S, left padding of row 1, block size, top_k)
    (4, 16, 16, 0, 4, 2),
    (2, 11, 19, 0, 3, 3),
    (1, 1, 23, 0, 4, 2),  # one decoding query, cached keys
    (2, 13, 13, 5, 4, 2),  # a left-padded row
    (2, 7, 21, 3, 2, 4),
    (4, 20, 20, 0, 1, 5),  # one-token blocks
]


@pytest.mark.parametrize("kv, t, s, pad, bs, top_k", CASES)
def test_selection_mask_equals_the_loop_formula(kv, t, s, pad, bs, top_k):
    q, k, v = random_qkv(kv=kv, t=t, s=s)
    key_mask = left_padding(2, s, pad) if pad else None
    mask, _ = pipeline(q, k, v, key_mask, bs, top_k)
    assert torch.equal(mask, loop_mask(q, k, key_mask, bs, top_k))


@pytest.mark.parametrize("kv, t, s, pad, bs, top_k", CASES)
def test_no_query_sees_a_later_token(kv, t, s, pad, bs, top_k):
    q, k, v = random_qkv(kv=kv, t=t, s=s)
    key_mask = left_padding(2, s, pad) if pad else None
    mask, _ = pipeline(q, k, v, key_mask, bs, top_k)
    later = torch.arange(s)[None, :] > torch.arange(s - t, s)[:, None]  # (T, S)
    assert not (mask & later).any()
    # and each real query sees itself (its own block is always selected)
    diag = torch.zeros(t, s, dtype=torch.bool)
    diag[torch.arange(t), torch.arange(s - t, s)] = True
    real_q = (key_mask if key_mask is not None else torch.ones(2, s, dtype=torch.bool))[:, -t:]
    assert torch.equal((mask & diag).any(-1), real_q[:, None, :].expand(-1, 4, -1))


@pytest.mark.parametrize("kv, t, s, pad, bs, top_k", CASES)
@pytest.mark.parametrize("alibi", [False, True])
def test_gathered_equals_dense(kv, t, s, pad, bs, top_k, alibi):
    q, k, v = random_qkv(kv=kv, t=t, s=s, dtype=torch.float32)
    key_mask = left_padding(2, s, pad) if pad else None
    mask, (kc, vc, order, blocks, valid, qi) = pipeline(q, k, v, key_mask, bs, top_k)
    bias = None
    if alibi:
        dist = torch.arange(s)[None, :] - torch.arange(s - t, s)[:, None]  # (T, S)
        bias = alibi_slopes(4)[:, None, None] * dist.clamp_max(0)  # (H, T, S)
    dense, _ = attend(
        q, k, v, backend=attention_math, scale=0.3, n_rep=4 // kv,
        mask_fn=lambda *_: mask, key_mask=key_mask, bias=bias,
    )  # fmt: skip
    got = gathered_attention(q, kc, vc, blocks, valid, qi, bs, 0.3, bias, order)
    assert (got - dense).abs().max().item() < 1e-6


def module_pair(kind_b, **attention):
    """A MoBA module and a ``kind_b`` module (moba: the dense path) with the same weights,
    eval mode."""
    a_cfg = moba_cfg(**attention)
    b_cfg = (
        moba_cfg(**dict(attention, moba_impl="dense"))
        if kind_b == "moba"
        else tiny_model_config(attention={"n_heads": 4, "kind": kind_b})
    )
    torch.manual_seed(0)
    a = ATTENTION.get("moba", "k")(a_cfg).double().eval()
    b = ATTENTION.get(kind_b, "k")(b_cfg).double().eval()
    b.load_state_dict(a.state_dict())
    return a, b, POSITION.get(a_cfg.position.kind, "p")(a_cfg)


@pytest.mark.parametrize("impl", ["gathered", "dense"])
def test_top_k_covering_every_block_is_full_causal_attention(impl):
    a, b, pos = module_pair("softmax", moba_block_size=4, moba_top_k=8, moba_impl=impl)
    x = torch.randn(2, 32, 32, dtype=torch.float64)  # 8 blocks of 4
    positions = torch.arange(32)
    with torch.no_grad():
        diff = (a(x, pos, positions).out - b(x, pos, positions).out).abs().max().item()
    assert diff < 1e-12


def test_sparse_moba_differs_from_full_attention():
    a, b, pos = module_pair("softmax", moba_block_size=4, moba_top_k=2)
    x = torch.randn(2, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        diff = (a(x, pos, torch.arange(32)).out - b(x, pos, torch.arange(32)).out).abs().max()
    assert diff > 1e-3


def test_gathered_module_equals_dense_module_and_its_weights_are_causal():
    gathered, dense, pos = module_pair("moba", moba_block_size=3, moba_top_k=2)
    assert (gathered.impl, dense.impl) == ("gathered", "dense")
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    positions = torch.arange(20)
    with torch.no_grad():
        got = gathered(x, pos, positions).out
        want, weights = forward_with_map(dense, x, pos, positions)
    assert (got - want.out).abs().max().item() < 1e-12
    assert not torch.triu(weights, diagonal=1).any()
    x2 = x.clone()
    x2[:, 12:] = torch.randn(2, 8, 32, dtype=torch.float64)  # change tokens 12..
    with torch.no_grad():
        got2 = gathered(x2, pos, positions).out
    assert torch.equal(got2[:, :12], got[:, :12])


def score_elements(fn, *args, **kwargs) -> list[int]:
    """Elements of each distinct softmax output (a score tensor) autograd saves while running
    ``fn(*args, **kwargs)`` (the math path saves its weights twice: softmax, product with v)."""
    sizes: dict[int, int] = {}

    def pack(t):
        if t.grad_fn is not None and type(t.grad_fn).__name__.startswith("Softmax"):
            sizes[t.data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return list(sizes.values())


def test_gathered_score_memory_falls_with_sparsity():
    b, h, t, bs = 1, 4, 64, 8  # N = 8 blocks
    q, k, v = random_qkv(b=b, h=h, kv=h, t=t, s=t, hd=8, dtype=torch.float32)
    q.requires_grad_(True)
    counts = {}
    for top_k in (1, 2, 4, 8):
        mask, (kc, vc, order, blocks, valid, qi) = pipeline(q, k, v, None, bs, top_k)
        args = (q, kc, vc, blocks, valid, qi, bs, 1.0)
        (counts[top_k],) = score_elements(gathered_attention, *args)
        assert counts[top_k] == b * h * t * top_k * bs
    full = score_elements(
        attend, q, k, v, backend=attention_math, scale=1.0, mask_fn=lambda *_: mask
    )
    assert full == [b * h * t * t]
    assert counts[1] < counts[2] < counts[4] < b * h * t * t == counts[8]


@pytest.mark.parametrize(
    "attention, needle",
    [
        ({"moba_block_size": 33}, "moba_block_size"),
        ({"moba_block_size": 0}, "moba_block_size"),
        ({"moba_top_k": 0}, "moba_top_k"),
        ({"moba_impl": "flash"}, "moba_impl"),
        ({"mask": "sliding_window", "window": 4}, "mask=causal"),
    ],
)
def test_check_refuses_bad_options(attention, needle):
    with pytest.raises(ConfigError, match=needle):
        moba_cfg(**attention)


def test_fields_are_refused_on_other_kinds():
    with pytest.raises(ConfigError, match="moba_top_k"):
        tiny_model_config(attention={"n_heads": 4, "moba_top_k": 2})
