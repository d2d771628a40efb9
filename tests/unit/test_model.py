"""Model-level facts: initial loss, init scales, tying, the loss, returned states.

The contract of every registered variant (causality, cached decoding, round trips, ...) is
generated in tests/contract/ from the variants' declared ``examples``.
"""

import math

import pytest
import torch
from safetensors.torch import load_model, save_model

from lmlab.models import build_model
from tests.helpers import tiny_model_config


def make(variant: dict) -> torch.nn.Module:
    return build_model(tiny_model_config(vocab_size=37, **variant)).eval()


def test_initial_loss_is_near_uniform_and_init_scales_residual_projections():
    cfg = tiny_model_config(vocab_size=200, d_model=64, n_layers=8)
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = torch.randint(0, 200, (8, 32)), torch.randint(0, 200, (8, 32))
    with torch.no_grad():
        loss = float(model(x, targets=y).loss)
    assert abs(loss - math.log(200)) < 0.1
    model.requires_grad_(False)
    o_std = torch.cat([layer.attn.o_proj.weight.flatten() for layer in model.layers]).std()
    q_std = torch.cat([layer.attn.q_proj.weight.flatten() for layer in model.layers]).std()
    assert float(q_std) == pytest.approx(0.02, rel=0.05)
    assert float(o_std) == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)


def test_weight_tying_shares_one_matrix_and_counts_it_once():
    tied = build_model(tiny_model_config(vocab_size=50))
    untied = build_model(tiny_model_config(vocab_size=50, tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.num_params() - tied.num_params() == 50 * 32
    assert tied.num_params(non_embedding=True) == tied.num_params() - 50 * 32


def test_loss_is_mean_cross_entropy_in_nats_and_ignores_minus_100():
    model = make({})
    x = torch.randint(0, 37, (2, 6))
    t = x.clone()
    t[0, :3] = -100
    out = model(x, targets=t)
    logp = torch.log_softmax(out.logits.float(), -1)
    keep = t >= 0
    manual = -logp[keep].gather(-1, t[keep][:, None]).mean()
    torch.testing.assert_close(out.loss, manual)


def test_hidden_states_and_attention_weights_are_returned_on_request():
    model = make({})
    out = model(torch.randint(0, 37, (1, 5)), need_weights=True, output_hidden_states=True)
    assert len(out.hidden_states) == model.cfg.n_layers + 1
    assert len(out.attentions) == model.cfg.n_layers
    assert out.attentions[0].shape == (1, 4, 5, 5)


@pytest.mark.parametrize(
    "scheme, std, residual_std",
    [
        ("gpt2", 0.02, 0.02 / math.sqrt(2 * 8)),
        ("normal", 0.02, 0.02),
        ("small", math.sqrt(2 / (5 * 64)), 2 / 8 / math.sqrt(64)),
    ],
)
def test_init_schemes_follow_their_formulas(scheme, std, residual_std):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=200, d_model=64, n_layers=8, init=scheme))
    model.requires_grad_(False)
    q = torch.cat([layer.attn.q_proj.weight.flatten() for layer in model.layers])
    down = torch.cat([layer.ffn.down_proj.weight.flatten() for layer in model.layers])
    assert float(q.std()) == pytest.approx(std, rel=0.05)
    assert float(down.std()) == pytest.approx(residual_std, rel=0.05)
    assert float(model.embed.weight.std()) == pytest.approx(std, rel=0.05)


def test_parallel_block_adds_both_branches_of_the_same_input():
    model = build_model(tiny_model_config(vocab_size=37, block={"kind": "pre", "parallel": True}))
    layer = model.layers[0].eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = layer(x, model.position, torch.arange(5))
        attn = layer.attn(layer.attn_norm(x), model.position, torch.arange(5)).out
        expected = x + attn + layer.ffn(layer.ffn_norm(x))
    torch.testing.assert_close(got, expected)


def test_parallel_needs_pre_norm():
    from lmlab.errors import ConfigError

    with pytest.raises(ConfigError, match="model.block.parallel needs model.block.kind=pre"):
        tiny_model_config(block={"kind": "post", "parallel": True})


def _tied_models():
    from tests.helpers import encoder_config

    seq2seq = tiny_model_config(vocab_size=50, kind="encoder_decoder", position={"kind": "learned"})
    return {
        "decoder": build_model(tiny_model_config(vocab_size=50)),
        "encoder": build_model(encoder_config(vocab_size=50)),
        "encoder_decoder": build_model(seq2seq),
    }


def _other_weights(model):
    """A state dict of the same shapes with new values (so a load visibly changes the model)."""
    return {
        k: torch.randn_like(v) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }


TIE_LOADS = {
    "assign, both names": (lambda sd: sd, {"assign": True}),
    "only the embedding": (lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"}, {}),
    "only the head": (lambda sd: {k: v for k, v in sd.items() if k != "embed.weight"}, {}),
    "only the embedding, assign": (
        lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"},
        {"assign": True},
    ),
    "only the head, assign": (
        lambda sd: {k: v for k, v in sd.items() if k != "embed.weight"},
        {"assign": True},
    ),
}


@pytest.mark.parametrize("family", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("load", list(TIE_LOADS))
def test_tied_embeddings_stay_tied_through_every_state_dict_load(family, load):
    model = _tied_models()[family]
    n = model.num_params()
    sd = _other_weights(model)
    sd["lm_head.weight"] = sd["embed.weight"]  # a tied model's state dict: one matrix
    select, kwargs = TIE_LOADS[load]
    model.load_state_dict(select(sd), strict=True, **kwargs)
    assert model.lm_head.weight is model.embed.weight
    assert model.num_params() == n
    torch.testing.assert_close(model.embed.weight, sd["embed.weight"], rtol=0, atol=0)
    model.embed.weight.grad = None
    model.lm_head.weight.sum().backward()  # a gradient reaches the one shared parameter
    assert model.embed.weight.grad is not None


@pytest.mark.parametrize("family", ["decoder", "encoder", "encoder_decoder"])
def test_tied_embeddings_stay_tied_through_safetensors_and_the_checkpoint_loader(family, tmp_path):
    from lmlab.training.checkpoint import MODEL_FILE, load_model_weights

    source, target = _tied_models()[family], _tied_models()[family]
    with torch.no_grad():
        source.embed.weight.mul_(-1)
    n = target.num_params()
    save_model(source, str(tmp_path / MODEL_FILE))  # keeps one name of the shared matrix
    load_model_weights(tmp_path, target)
    assert target.lm_head.weight is target.embed.weight and target.num_params() == n
    torch.testing.assert_close(target.lm_head.weight, source.embed.weight, rtol=0, atol=0)
    missing, unexpected = load_model(target, str(tmp_path / MODEL_FILE), strict=False)
    assert not missing and not unexpected
    assert target.lm_head.weight is target.embed.weight and target.num_params() == n


def test_a_state_dict_with_two_different_tied_matrices_is_refused():
    from lmlab.errors import LmlabError

    model = build_model(tiny_model_config(vocab_size=50))
    sd = _other_weights(model)  # lm_head.weight and embed.weight differ
    before = model.embed.weight.detach().clone()
    with pytest.raises(LmlabError, match="lm_head.weight.*tie_embeddings=false"):
        model.load_state_dict(sd)
    torch.testing.assert_close(model.embed.weight, before, rtol=0, atol=0)


def test_a_model_nested_in_a_wrapper_stays_tied_after_an_assign_load():
    wrapper = torch.nn.ModuleDict({"model": build_model(tiny_model_config(vocab_size=50))})
    n = sum(p.numel() for p in wrapper.parameters())  # parameters() deduplicates
    wrapper.load_state_dict(wrapper.state_dict(), assign=True)
    assert wrapper["model"].lm_head.weight is wrapper["model"].embed.weight
    assert sum(p.numel() for p in wrapper.parameters()) == n
