"""block.kind=hyper: hyper-connections (Zhu et al. 2024) and mHC's Sinkhorn constraint (Xie et
al. 2025), checked against the Pre-Norm block and a float64 reference of the paper's equations."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.models.build import build_model
from lmlab.nn.block import BLOCK
from lmlab.nn.hyper_connections import HyperConnection, sinkhorn
from lmlab.nn.position import POSITION
from tests.helpers import tiny_config, tiny_model_config

HC_KEYS = ("a_m", "a_r", "beta", "w_m", "w_r", "w_b", "s_a", "s_b")


def _hyper(**block):
    return tiny_model_config(block={"kind": "hyper", **block})


def _pair(**block):
    """A Pre-Norm model and a hyper model holding the same attention/FFN/norm/embedding weights."""
    torch.manual_seed(0)
    pre = build_model(tiny_model_config()).eval()
    hyper = build_model(_hyper(**block)).eval()
    missing, unexpected = hyper.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and missing
    assert all(k.rsplit(".", 1)[-1] in HC_KEYS for k in missing)  # only the HC coefficients
    return pre, hyper


def _perturb_hc(model, scale=0.5):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in HC_KEYS:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("block", [{}, {"hc_constraint": "sinkhorn"}])
def test_one_stream_is_exactly_the_pre_norm_model(block):
    pre, hyper = _pair(n_streams=1, **block)
    if block:  # with Sinkhorn a 1 x 1 residual matrix is exactly 1 whatever its logit
        _perturb_hc_only = {k: v for k, v in hyper.named_parameters() if k.endswith("a_r")}
        with torch.no_grad():
            for p in _perturb_hc_only.values():
                p.fill_(3.7)
    x = torch.randint(0, 50, (2, 11))
    a = pre(x, output_hidden_states=True)
    b = hyper(x, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits)  # bit for bit: every coefficient is exactly 1
    assert all(torch.equal(u, v) for u, v in zip(a.hidden_states, b.hidden_states, strict=True))


def test_one_stream_equals_pre_norm_when_decoding_with_the_cache():
    pre, hyper = _pair(n_streams=1)
    x = torch.randint(0, 50, (2, 9))
    outs = []
    for model in (pre, hyper):
        cache = model.new_cache()
        model(x[:, :5], cache=cache)
        outs.append(torch.cat([model(x[:, i : i + 1], cache=cache).logits for i in range(5, 9)], 1))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("n", [2, 4])
def test_the_paper_init_keeps_every_stream_the_pre_norm_stream(n):
    # A_m = e_{k mod n}, A_r = I, B = 1 (eq. 14): each of the n streams equals the Pre-Norm
    # residual stream, their sum n times it, which is what the final norm reads
    pre, hyper = _pair(n_streams=n)
    x = torch.randint(0, 50, (2, 11))
    b = hyper(x, output_hidden_states=True)
    pre.final_norm.register_forward_pre_hook(lambda _, args: (n * args[0],))
    a = pre(x, output_hidden_states=True)
    for u, v in zip(a.hidden_states[:-1], b.hidden_states[:-1], strict=True):
        torch.testing.assert_close(v, n * u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)


def _reference_block(block, h, position, pos):
    """Eq. 2-5 of Zhu et al. with explicit sums over the streams, float64: per sublayer T,
    h_0 = sum_j A_m[j] H_j, H_i <- B_i T(h_0) + sum_j A_r[j, i] H_j."""
    n = h.shape[-2]

    def hc(conn, h, sublayer):
        a_m, a_r, beta = conn.a_m, conn.a_r.view(n, n), conn.beta
        h0 = sum(a_m[j] * h[..., j, :] for j in range(n))
        out = sublayer(h0)
        streams = [
            beta[i] * out + sum(a_r[j, i] * h[..., j, :] for j in range(n)) for i in range(n)
        ]
        return torch.stack(streams, dim=-2)

    h = hc(block.attn_hc, h, lambda u: block.attn(block.attn_norm(u), position, pos).out)
    return hc(block.ffn_hc, h, lambda u: block.ffn(block.ffn_norm(u)))


def test_static_hc_update_matches_a_float64_reference_for_two_streams():
    cfg = _hyper(n_streams=2)
    torch.manual_seed(0)
    block = BLOCK.get("hyper")(cfg, 1).double().eval()
    _perturb_hc(block)
    position = POSITION.get(cfg.position.kind)(cfg)
    h = torch.randn(2, 5, 2, cfg.d_model, dtype=torch.float64)
    pos = torch.arange(5)
    got = block(h, position, pos)
    want = _reference_block(block, h, position, pos)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the streams really are mixed: swapping the two input streams changes the output
    assert not torch.allclose(block(h.flip(-2), position, pos), got)


def test_the_embedding_is_copied_into_the_streams_and_they_are_summed_before_the_final_norm():
    block = BLOCK.get("hyper")(_hyper(n_streams=3), 0)
    x = torch.randn(2, 4, 32)
    h = block.expand_stream(x)
    assert h.shape == (2, 4, 3, 32) and all(torch.equal(h[:, :, i], x) for i in range(3))
    torch.testing.assert_close(block.reduce_stream(h), 3 * x)


def test_layer_k_reads_stream_k_mod_n_at_init():
    cfg = _hyper(n_streams=3)
    for k in range(5):
        conn = HyperConnection(cfg, k)
        assert conn.a_m.tolist() == [1.0 if i == k % 3 else 0.0 for i in range(3)]
        assert torch.equal(conn.a_r.view(3, 3), torch.eye(3)) and conn.beta.tolist() == [1.0] * 3


def test_sinkhorn_gives_a_doubly_stochastic_matrix():
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(6, 4, dtype=torch.float64)
    # logits of std 1 (mHC's 20 rounds), and of std 2, which needs more rounds (100)
    for std, iters in ((1.0, 20), (2.0, 100)):
        logits = std * torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
        m = sinkhorn(logits, iters)
        assert (m > 0).all()
        torch.testing.assert_close(m.sum(-1), ones, rtol=0, atol=1e-6)  # rows
        torch.testing.assert_close(m.sum(-2), ones, rtol=0, atol=1e-12)  # columns: the last step
    errors = [float((sinkhorn(logits, i).sum(-1) - 1).abs().max()) for i in (5, 20, 50)]
    assert errors[0] > errors[1] > errors[2]  # it converges: each round brings the rows closer
    assert torch.equal(sinkhorn(torch.tensor([[5.0]]), 3), torch.ones(1, 1))


def test_the_hc_residual_matrix_with_sinkhorn_is_doubly_stochastic_static_and_dynamic():
    for dynamic in (False, True):
        cfg = _hyper(n_streams=4, hc_constraint="sinkhorn", dynamic=dynamic)
        conn = HyperConnection(cfg, 0).double()
        _perturb_hc(conn, scale=1.0)
        h = torch.randn(2, 3, 4, 32, dtype=torch.float64)
        _, a_r, _ = conn.coefficients(h)
        assert a_r.shape == ((2, 3, 4, 4) if dynamic else (4, 4))
        torch.testing.assert_close(a_r.sum(-1), torch.ones_like(a_r.sum(-1)), rtol=0, atol=1e-6)
        torch.testing.assert_close(a_r.sum(-2), torch.ones_like(a_r.sum(-2)), rtol=0, atol=1e-6)
    # at init the logits are 0: A_r = 1 / n
    assert torch.equal(HyperConnection(_hyper(hc_constraint="sinkhorn"), 0).coefficients(h)[1],
                       torch.full((4, 4), 0.25))  # fmt: skip


def test_dynamic_coefficients_start_at_the_static_ones_and_depend_on_the_token():
    cfg = _hyper(n_streams=2, dynamic=True)
    conn = HyperConnection(cfg, 0)
    h = torch.randn(2, 3, 2, 32)
    a_m, a_r, beta = conn.coefficients(h)  # W_* = 0: tanh(0) = 0
    assert torch.equal(a_m, conn.a_m.expand(2, 3, 2)) and torch.equal(
        beta, conn.beta.expand(2, 3, 2)
    )
    _perturb_hc(conn)
    a_m, _, _ = conn.coefficients(h)
    assert not torch.allclose(a_m[0, 0], a_m[0, 1])


@pytest.mark.parametrize(
    "block", [{"n_streams": 2}, {"n_streams": 2, "dynamic": True, "hc_constraint": "sinkhorn"}]
)
def test_gradients_reach_every_hc_parameter(block):
    torch.manual_seed(0)
    model = build_model(_hyper(**block))
    _perturb_hc(model, scale=0.1)  # as after some steps: unequal streams, W_* != 0
    x = torch.randint(0, 50, (2, 8))
    model(x, targets=x).loss.backward()
    hc = {k: p.grad for k, p in model.named_parameters() if k.rsplit(".", 1)[-1] in HC_KEYS}
    assert len(hc) == 2 * 2 * (8 if block.get("dynamic") else 3)  # 2 layers x 2 sublayers
    for name, grad in hc.items():
        assert grad is not None and torch.isfinite(grad).all(), name
        if "hc_constraint" in block and name.startswith("layers.1.ffn_hc.") and "_r" in name:
            # the streams are summed after the last sublayer, and the rows of a doubly
            # stochastic A_r sum to 1: the last mix cannot change the output
            assert grad.abs().max() < 1e-30, name  # 0 up to rounding
        else:
            assert grad.any(), name


def test_at_init_the_sinkhorn_logits_get_no_gradient_the_streams_being_equal():
    # every stream starts as the same Pre-Norm stream, and a doubly stochastic matrix maps
    # equal streams to themselves: A_r starts learning once B or A_m has made them differ
    torch.manual_seed(0)
    model = build_model(_hyper(n_streams=2, hc_constraint="sinkhorn"))
    x = torch.randint(0, 50, (2, 8))
    model(x, targets=x).loss.backward()
    for name, p in model.named_parameters():
        if name.endswith(".a_r"):
            assert not p.grad.any(), name
        elif name.endswith((".beta", ".a_m")):
            assert p.grad.any(), name


def test_parameter_count_grows_by_the_hc_coefficients():
    base = build_model(tiny_model_config()).num_params()
    for n in (1, 2, 4):  # per sublayer A_m (n) + A_r (n^2) + B (n); 2 layers x 2 sublayers
        assert build_model(_hyper(n_streams=n)).num_params() == base + 4 * (2 * n + n * n)


@pytest.mark.parametrize(
    "block, needle",
    [
        ({"n_streams": 0}, "model.block.n_streams"),
        ({"hc_constraint": "softmax"}, "model.block.hc_constraint"),
        ({"hc_constraint": "sinkhorn", "sinkhorn_iters": 0}, "model.block.sinkhorn_iters"),
        ({"sinkhorn_iters": 5}, "hc_constraint=sinkhorn"),
        ({"residual": False}, "model.block.residual"),
        ({"parallel": True}, "model.block.parallel"),
    ],
)
def test_bad_options_are_refused_by_name(block, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        _hyper(**block)


def test_hc_fields_are_refused_on_other_block_kinds_and_encoder_decoder_is_refused():
    with pytest.raises(ConfigError, match=r"model\.block\.n_streams applies to"):
        tiny_model_config(block={"kind": "pre", "n_streams": 2})
    with pytest.raises(ConfigError, match="block.kind"):
        tiny_config(model={"kind": "encoder_decoder", "block": {"kind": "hyper"}})
