"""Mixture of Experts: routing, auxiliary losses and expert counts against hand computations."""

import math

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.models import build_model
from lmlab.nn import FFN, ROUTERS, MoE
from lmlab.nn.moe import load_balancing_loss, router_z_loss, softmax_topk, topk_softmax
from lmlab.training.flops import matmul_params
from lmlab.training.metrics import read_metrics
from lmlab.training.trainer import train
from tests.helpers import tiny_config, tiny_model_config


def moe_cfg(**ffn: object):
    return tiny_model_config(ffn={"kind": "moe", "n_experts": 4, "top_k": 2, **ffn})


def hand_balance_loss(layers: list[list[list[float]]], k: int) -> float:
    """E * sum_e f_e P_e with plain Python floats over all layers' rows."""
    n_experts = len(layers[0][0])
    counts, prob_sum, rows = [0.0] * n_experts, [0.0] * n_experts, 0
    for layer in layers:
        for logits in layer:
            z = [math.exp(v) for v in logits]
            p = [v / sum(z) for v in z]
            for e in sorted(range(n_experts), key=lambda e: -p[e])[:k]:
                counts[e] += 1
            prob_sum = [a + b for a, b in zip(prob_sum, p, strict=True)]
            rows += 1
    return n_experts * sum(c / rows * s / rows for c, s in zip(counts, prob_sum, strict=True))


def test_balance_loss_equals_its_definition_on_a_hand_made_routing():
    # two layers, 3 tokens, 3 experts; distinct logits so the top-k is unambiguous
    layers = [
        [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.1, 3.0]],
        [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [-2.0, 0.0, 2.0]],
    ]
    for k in (1, 2, 3):
        got = load_balancing_loss([torch.tensor(x) for x in layers], k)
        assert float(got) == pytest.approx(hand_balance_loss(layers, k), rel=1e-6)
    # top-1, layer 0 alone: expert 0, 1, 2 each get one token (f = 1/3), so loss = 3 * sum P / 3
    assert float(load_balancing_loss([torch.tensor(layers[0])], 1)) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_balance_loss_under_uniform_routing_is_top_k_and_1_for_top_1(k):
    n_experts = 4
    uniform_probs = torch.zeros(10, n_experts)  # P_e = 1/E (top-k picks experts 0..k-1: f skewed)
    assert float(load_balancing_loss([uniform_probs], k)) == pytest.approx(k)
    # balanced assignments (f_e = k/E) with far from uniform probabilities
    balanced = torch.stack([torch.roll(torch.tensor([5.0, 3.0, 1.0, -2.0]), s) for s in range(4)])
    assert float(load_balancing_loss([balanced, 3 * balanced], k)) == pytest.approx(k)
    if k == 1:  # the Switch Transformer's normalisation: 1 under uniform routing
        assert float(load_balancing_loss([uniform_probs], 1)) == pytest.approx(1.0)


def test_balance_loss_grows_when_routing_collapses_onto_one_expert():
    collapsed = torch.tensor([[4.0, 0.0, 0.0, 0.0]] * 8)
    assert float(load_balancing_loss([collapsed], 1)) > 3.0  # -> E as the router saturates


def test_router_z_loss_equals_its_float64_formula():
    logits = [torch.randn(7, 5) * 3, torch.randn(7, 5)]
    ref = torch.cat([torch.logsumexp(x.double(), -1) for x in logits]).pow(2).mean()
    torch.testing.assert_close(router_z_loss(logits).double(), ref, rtol=1e-6, atol=0)
    assert float(router_z_loss([torch.zeros(3, 4)])) == pytest.approx(math.log(4) ** 2)


@pytest.mark.parametrize("router", ["topk_softmax", "softmax_topk"])
def test_top_k_selects_the_k_largest_router_probabilities(router):
    logits = torch.randn(50, 6)
    _, idx = ROUTERS.get(router)(logits, 3)
    largest = torch.softmax(logits, -1).argsort(-1, descending=True)[:, :3]
    assert (idx.sort(-1).values == largest.sort(-1).values).all()


def test_router_gates_equal_float64_hand_computation():
    logits = torch.randn(20, 5, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    top_p, idx = p.topk(2, -1)
    mixtral = top_p / top_p.sum(-1, keepdim=True)  # HF Mixtral: softmax, top-k, renormalise
    after = torch.exp(logits.gather(-1, idx)) / torch.exp(logits.gather(-1, idx)).sum(-1, True)
    g1, i1 = topk_softmax(logits, 2)
    g2, i2 = softmax_topk(logits, 2)
    assert (i1 == idx).all() and (i2 == idx).all()
    torch.testing.assert_close(g1, after, rtol=1e-12, atol=0)
    torch.testing.assert_close(g1, mixtral, rtol=1e-12, atol=0)  # the same function
    torch.testing.assert_close(g2, top_p, rtol=1e-12, atol=0)  # not renormalised
    torch.testing.assert_close(g2, g1 * top_p.sum(-1, keepdim=True), rtol=1e-12, atol=0)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("router", ["topk_softmax", "softmax_topk"])
def test_moe_output_equals_float64_per_token_sum_of_gated_experts(router, shared):
    cfg = moe_cfg(router=router, shared_expert=shared, n_experts=5, top_k=2)
    moe = MoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    moe.requires_grad_(False)
    got = moe(x)
    ref = torch.zeros_like(x)
    for b in range(2):
        for t in range(6):
            xt = x[b, t]
            logits = moe.router.weight @ xt
            p = torch.softmax(logits, -1)
            chosen = sorted(range(5), key=lambda e: -float(p[e]))[:2]
            z = sum(math.exp(float(logits[e])) for e in chosen)
            for e in chosen:
                gate = math.exp(float(logits[e])) / z if router == "topk_softmax" else p[e]
                ref[b, t] += gate * moe.experts[e](xt)
            if shared:
                ref[b, t] += moe.shared_expert(xt)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("expert", ["swiglu", "mlp", "geglu"])
@pytest.mark.parametrize("router", ["topk_softmax", "softmax_topk"])
def test_one_expert_top_1_equals_that_experts_ffn(expert, router):
    cfg = moe_cfg(n_experts=1, top_k=1, expert=expert, router=router)
    moe = MoE(cfg)
    ffn_cfg = tiny_model_config(ffn={"kind": expert})
    ffn = FFN.get(expert)(ffn_cfg)
    ffn.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(moe(x), ffn(x), rtol=0, atol=0)


def test_expert_counts_sum_to_tokens_times_top_k_and_count_the_routing():
    model = build_model(moe_cfg(n_experts=6, top_k=3)).eval()
    logits: list[torch.Tensor] = []
    for layer in model.layers:
        layer.ffn.register_forward_hook(lambda m, i, o: logits.append(m.router_logits.detach()))
    out = model(torch.randint(0, 50, (3, 11)))
    assert len(out.expert_counts) == model.cfg.n_layers
    for counts, lg in zip(out.expert_counts, logits, strict=True):
        assert counts.shape == (6,) and counts.dtype == torch.int64
        assert int(counts.sum()) == 3 * 11 * 3
        assert (counts == torch.bincount(lg.topk(3, -1).indices.flatten(), minlength=6)).all()


def test_model_aux_loss_is_the_weighted_sum_pooled_over_layers():
    model = build_model(moe_cfg(aux_loss_coef=0.3, z_loss_coef=0.02)).eval()
    logits: list[torch.Tensor] = []
    for layer in model.layers:
        layer.ffn.register_forward_hook(lambda m, i, o: logits.append(m.router_logits.detach()))
    x = torch.randint(0, 50, (2, 9))
    out = model(x, targets=x)
    ref = 0.3 * load_balancing_loss(logits, 2) + 0.02 * router_z_loss(logits)
    torch.testing.assert_close(out.aux_loss, ref)
    plain = build_model(tiny_model_config())(x, targets=x)  # no MoE: no aux loss, no counts
    assert plain.aux_loss is None and plain.expert_counts == []
    assert all(m.router_logits is None for m in model.modules() if isinstance(m, MoE))


@torch.no_grad()
def test_padding_counts_in_neither_aux_loss():
    """Right padding under a causal mask leaves the real tokens' routing unchanged, so a padded
    batch's aux loss must equal the unpadded rows' (padding ids differ from row to row)."""
    model = build_model(moe_cfg(aux_loss_coef=0.3, z_loss_coef=0.02)).eval()
    rows = torch.randint(0, 50, (2, 9))
    pads = torch.randint(0, 50, (2, 5))
    padded = torch.cat([rows, pads], dim=1)  # (2, 14)
    mask = torch.cat([torch.ones(2, 9), torch.zeros(2, 5)], dim=1).long()
    plain = model(rows).aux_loss
    masked = model(padded, attention_mask=mask).aux_loss
    torch.testing.assert_close(masked, plain, rtol=1e-6, atol=1e-7)
    # each loss on its own: logits of the real rows, then of the padded batch under its mask
    logits: list[torch.Tensor] = []
    hooks = [
        layer.ffn.register_forward_hook(lambda m, i, o: logits.append(m.router_logits))
        for layer in model.layers
    ]
    model(rows)
    real = list(logits)
    logits.clear()
    model(padded, attention_mask=mask)
    for h in hooks:
        h.remove()
    flat = mask.reshape(-1)
    torch.testing.assert_close(
        load_balancing_loss(logits, 2, flat), load_balancing_loss(real, 2), rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(router_z_loss(logits, flat), router_z_loss(real))
    assert not torch.allclose(router_z_loss(logits), router_z_loss(real))  # padding would count


def test_aux_loss_trains_the_router_even_with_top_1_topk_softmax():
    model = build_model(moe_cfg(top_k=1, router="topk_softmax"))
    x = torch.randint(0, 50, (2, 9))
    out = model(x, targets=x)
    out.loss.backward(retain_graph=True)  # gate == 1: the LM loss gives the router nothing
    assert float(model.layers[0].ffn.router.weight.grad.abs().sum()) == 0.0
    out.aux_loss.backward()
    assert float(model.layers[0].ffn.router.weight.grad.abs().sum()) > 0.0


def test_flops_count_only_the_top_k_experts_a_token_visits():
    dense = build_model(tiny_model_config(ffn={"kind": "swiglu", "d_ff": 48}))
    moe = build_model(moe_cfg(n_experts=4, top_k=2, d_ff=48, shared_expert=True))
    expert = 3 * 32 * 48
    router = 32 * 4
    # per layer: 2 routed experts + the shared expert + the router, vs one dense FFN
    assert matmul_params(moe) - matmul_params(dense) == 2 * (2 * expert + router)


@pytest.mark.parametrize(
    ("ffn", "message"),
    [
        ({"top_k": 5}, r"model\.ffn\.top_k \(5\) must not exceed model\.ffn\.n_experts \(4\)"),
        ({"n_experts": 0}, r"model\.ffn\.n_experts must be > 0"),
        ({"top_k": 0}, r"model\.ffn\.top_k must be > 0"),
        ({"router": "softmax"}, r"model\.ffn\.router: .*allowed: topk_softmax, softmax_topk"),
        ({"expert": "moe"}, r"model\.ffn\.expert: 'moe' is not allowed; allowed: mlp, swiglu"),
        ({"aux_loss_coef": -1.0}, r"model\.ffn\.aux_loss_coef must be >= 0"),
        ({"z_loss_coef": -1.0}, r"model\.ffn\.z_loss_coef must be >= 0"),
    ],
)
def test_moe_config_errors_name_the_field_and_allowed_values(ffn, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(model={"ffn": {"kind": "moe", "n_experts": 4, **ffn}})


def test_three_step_training_logs_aux_loss_and_expert_counts_summed_over_the_window(tmp_path):
    cfg = tiny_config(
        model={"ffn": {"kind": "moe", "n_experts": 4, "top_k": 2}},
        train={"max_steps": 3, "log_every": 2, "eval_batches": 1},
    )
    train(cfg, out=tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert [r["step"] for r in rows] == [2, 3]
    per_step = 4 * 32 * 2  # batch_size * seq_len * top_k routed (token, slot) pairs per layer
    for r, steps in zip(rows, (2, 1), strict=True):  # step 2 covers steps 1-2, step 3 covers 3
        assert r["aux_loss"] > 0 and math.isfinite(r["aux_loss"])
        assert len(r["expert_counts"]) == 2 and all(len(c) == 4 for c in r["expert_counts"])
        assert all(sum(c) == steps * per_step for c in r["expert_counts"])
