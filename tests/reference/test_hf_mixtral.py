"""lmlab's MoE equals Hugging Face Mixtral built from a tiny config with random weights.

Nothing is downloaded (HF_HUB_OFFLINE=1). Logits are compared in float32 to 1e-5, full and cached;
the load-balancing loss is compared with transformers' ``load_balancing_loss_func``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

from lmlab.generation.generate import SamplingParams, generate_ids  # noqa: E402
from lmlab.interop.hf_mixtral import (  # noqa: E402
    mixtral_hf_state_dict,
    mixtral_model_config,
    mixtral_state_dict,
)
from lmlab.models import build_model  # noqa: E402
from lmlab.nn.moe import load_balancing_loss  # noqa: E402
from tests.helpers import hf_config, perturb_vectors  # noqa: E402

VOCAB = 97


def tiny_mixtral(tied: bool = False, top_k: int = 2, window: int | None = None) -> torch.nn.Module:
    cfg = hf_config(
        "mixtral",
        vocab_size=VOCAB,
        num_local_experts=4,
        num_experts_per_tok=top_k,
        tie_word_embeddings=tied,
        eos_token_id=None,
        sliding_window=window,
    )
    torch.manual_seed(0)
    model = perturb_vectors(transformers.MixtralForCausalLM(cfg))  # RMSNorm weights start at 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a spread-out router: no near-ties in top-k
                p.mul_(5.0)
    return model.eval()


def to_lmlab(hf_model: torch.nn.Module, sd: dict[str, torch.Tensor] | None = None):
    cfg = hf_model.config
    ours = build_model(mixtral_model_config(cfg)).eval()
    state = mixtral_state_dict(hf_model.state_dict() if sd is None else sd, cfg.tie_word_embeddings)
    ours.load_state_dict(state, strict=True)
    return ours


def assert_same_logits(hf_model, ours, x: torch.Tensor) -> None:
    with torch.no_grad():
        ref = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, ref, atol=1e-5, rtol=1e-5)
        cache = ours.new_cache()  # cached decoding reproduces the reference too
        steps = [ours(x[:, :9], cache=cache).logits]
        steps += [ours(x[:, t : t + 1], cache=cache).logits for t in range(9, x.shape[1])]
        torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=1e-5)
        mask = torch.ones_like(x)  # a left-padded row: equal logits on the real tokens
        mask[-1, :5] = 0
        keep = mask.bool()
        ref = hf_model(x, attention_mask=mask).logits[keep]
        torch.testing.assert_close(
            ours(x, attention_mask=mask).logits[keep], ref, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_logits_match_full_and_cached(tied, top_k):
    hf_model = tiny_mixtral(tied, top_k)
    assert_same_logits(hf_model, to_lmlab(hf_model), torch.randint(0, VOCAB, (2, 17)))


def test_mixtral_checkpoint_file_layout_converts_too(tmp_path):
    """save_pretrained writes per-expert w1/w2/w3 under block_sparse_moe (Mistral's layout)."""
    hf_model = tiny_mixtral()
    hf_model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in sd
    assert_same_logits(hf_model, to_lmlab(hf_model, sd), torch.randint(0, VOCAB, (2, 12)))


def test_mixtral_state_dict_round_trips_to_the_transformers_layout():
    hf_model = tiny_mixtral()
    ours = to_lmlab(hf_model)
    back = mixtral_hf_state_dict(ours.state_dict(), ours.cfg)
    ref = hf_model.state_dict()
    assert back.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(back[key], value), key
    hf_model.load_state_dict(back, strict=True)


def test_model_aux_loss_equals_hf_router_logits_aux_loss():
    hf_model = tiny_mixtral()
    ours = to_lmlab(hf_model)
    x = torch.randint(0, VOCAB, (3, 13))
    with torch.no_grad():
        ref = hf_model(x, output_router_logits=True)
        got = ours(x)
    coef = hf_model.config.router_aux_loss_coef  # lmlab's aux_loss carries the coefficient
    assert ours.cfg.ffn.aux_loss_coef == coef and ours.cfg.ffn.z_loss_coef == 0.0
    torch.testing.assert_close(got.aux_loss, coef * ref.aux_loss, rtol=1e-6, atol=0)
    # the expert counts are HF's top-k assignments per layer
    for counts, logits in zip(got.expert_counts, ref.router_logits, strict=True):
        hf_counts = torch.bincount(logits.topk(2, -1).indices.flatten(), minlength=4)
        assert (counts == hf_counts).all()


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_hf_load_balancing_loss_func(top_k, masked):
    layers = tuple(torch.randn(2 * 11, 5) * s for s in (0.5, 1.0, 3.0))  # 3 layers, B=2, T=11
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :4] = 0  # left padding on the first sequence
    ref = load_balancing_loss_func(layers, 5, top_k, mask if masked else None)
    got = load_balancing_loss(list(layers), top_k, mask if masked else None)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_hf_formula_under_uniform_routing_is_top_k():
    """The docstring's statement, checked on transformers' own function."""
    for k in (1, 2, 3):
        value = load_balancing_loss_func((torch.zeros(8, 4),), 4, k)
        assert float(value) == pytest.approx(k)


def test_greedy_generation_matches_token_for_token():
    hf_model = tiny_mixtral()
    ours = to_lmlab(hf_model)
    prompt = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        ref = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    got = list(generate_ids(ours, prompt[0].tolist(), params, max_seq_len=64))
    assert got == ref[0, 6:].tolist()


def test_mixtral_with_a_sliding_window_matches():
    hf_model = tiny_mixtral(window=5)
    ours = to_lmlab(hf_model)
    assert (ours.cfg.attention.mask, ours.cfg.attention.window) == ("sliding_window", 5)
    assert_same_logits(hf_model, ours, torch.randint(0, VOCAB, (2, 17)))
