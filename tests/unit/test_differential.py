"""Differential attention (Ye et al. 2024): equal to Hugging Face's DiffLlama built from a tiny
random config, equal to a float64 loop over the paper's equation, the lambda_init schedule, and
the kind's own config rules."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from lmlab.config import ModelConfig, config_from_dict
from lmlab.errors import ConfigError
from lmlab.interop.hf_diffllama import diffllama_model_config, diffllama_state_dict
from lmlab.models import build_model
from lmlab.nn.differential import DifferentialAttention, lambda_init_fn
from lmlab.nn.position import POSITION
from lmlab.validation import validate_model, validate_run_config
from tests.helpers import perturb_vectors, tiny_model_config
from tests.helpers.hf_models import LLAMA

V = 97


def diff_config(**attention) -> ModelConfig:
    return tiny_model_config(
        vocab_size=V, attention={"n_heads": 4, "kind": "differential", **attention}
    )


# ----------------------------------------------------------------------------- lambda_init


def test_lambda_init_schedule_is_the_papers_with_l_minus_1_the_0_based_layer():
    """0.8 - 0.6 exp(-0.3 (l - 1)), l = 1..L: 0.2 in the first layer, rising towards 0.8."""
    expected = [0.8 - 0.6 * math.exp(-0.3 * (l - 1)) for l in range(1, 9)]
    assert [lambda_init_fn(i) for i in range(8)] == pytest.approx(expected, abs=1e-15)
    assert lambda_init_fn(0) == pytest.approx(0.2)
    assert lambda_init_fn(1) == pytest.approx(0.35550907, abs=1e-8)  # 0.8 - 0.6 e^-0.3
    assert lambda_init_fn(2) == pytest.approx(0.47071302, abs=1e-8)  # 0.8 - 0.6 e^-0.6
    assert lambda_init_fn(100) == pytest.approx(0.8, abs=1e-12)
    model = build_model(diff_config())
    assert [layer.attn.lambda_init for layer in model.layers] == pytest.approx(
        [0.2, lambda_init_fn(1)], abs=1e-15
    )


def test_lambda_init_equals_hugging_faces():
    hf_diff = pytest.importorskip("transformers.models.diffllama.modeling_diffllama")
    assert [lambda_init_fn(i) for i in range(12)] == [hf_diff.lambda_init_fn(i) for i in range(12)]


# ----------------------------------------------------------------------------- the equation


def paper_reference(attn: DifferentialAttention, x: torch.Tensor) -> torch.Tensor:
    """The paper's eq. 1-3 as a loop over differential heads, float64, causal, no positions:
    head i pairs query heads i and H/2 + i with key heads j and K/2 + j (j = i // r) and the
    value [v_j, v_{K/2+j}] (Hugging Face's layout)."""
    b, t, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(b, t, h, hd)
    k = attn.k_proj(x).view(b, t, kv, hd)
    v = attn.v_proj(x).view(b, t, kv, hd)
    lam = (
        torch.exp(attn.lambda_q1 @ attn.lambda_k1)
        - torch.exp(attn.lambda_q2 @ attn.lambda_k2)
        + attn.lambda_init
    )
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    r = h // kv
    heads = []
    for i in range(h // 2):
        j = i // r
        maps = []
        for qh, kh in ((i, j), (h // 2 + i, kv // 2 + j)):
            s = q[:, :, qh] @ k[:, :, kh].transpose(1, 2) / math.sqrt(hd)  # (B, T, T)
            maps.append(torch.softmax(s.masked_fill(future, -math.inf), -1))
        value = torch.cat([v[:, :, j], v[:, :, kv // 2 + j]], -1)  # (B, T, 2 hd)
        y = (maps[0] - lam * maps[1]) @ value
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + attn.eps)  # RMSNorm, no weight
        heads.append((1 - attn.lambda_init) * y)
    return attn.o_proj(torch.cat(heads, -1))  # (B, T, D)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_forward_equals_the_papers_equation_in_float64(n_kv_heads: int, backend: str):
    cfg = diff_config(n_kv_heads=n_kv_heads, backend=backend, n_heads=8)
    cfg = dataclasses.replace(cfg, d_model=64)
    torch.manual_seed(0)
    attn = DifferentialAttention(cfg, layer_idx=3).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    position = POSITION.get("none")(cfg)
    with torch.no_grad():
        got = attn(x, position, torch.arange(9)).out
        ref = paper_reference(attn, x)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_weights_are_each_query_heads_softmax_map():
    """need_weights: (B, H, T, S), rows summing to 1, heads [0, H/2) the first maps."""
    model = build_model(diff_config()).eval()
    x = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        out = model(x, need_weights=True)
    w = out.attentions[0]
    assert w.shape == (2, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7))
    assert torch.all(w.triu(1) == 0)


# ----------------------------------------------------------------------------- Hugging Face


def _hf_model(n_kv_heads: int, tied: bool = False):
    transformers = pytest.importorskip("transformers")
    settings = {**copy.deepcopy(LLAMA), "num_key_value_heads": n_kv_heads, "lambda_std_dev": 0.3}
    cfg = transformers.DiffLlamaConfig(**{**settings, "tie_word_embeddings": tied})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cfg, perturb_vectors(transformers.DiffLlamaForCausalLM(cfg)).eval()


def lmlab_from_hf(cfg, hf_model) -> torch.nn.Module:
    """The DiffLlama weights in lmlab's decoder: Llama's rename, plus the lambda vectors."""
    ours_cfg = diffllama_model_config(cfg)
    validate_model(ours_cfg)
    ours = build_model(ours_cfg)
    sd = diffllama_state_dict(hf_model.state_dict(), cfg.tie_word_embeddings)
    ours.load_state_dict(sd, strict=True)
    return ours.eval()


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_logits_equal_hugging_face_diffllama(n_kv_heads: int):
    """A tiny random DiffLlamaForCausalLM (2 layers: lambda_init 0.2 and 0.356): equal logits
    (float32, 1e-5) on a full pass, through the KV cache, and on a left-padded batch."""
    cfg, hf_model = _hf_model(n_kv_heads)
    ours = lmlab_from_hf(cfg, hf_model)
    x = torch.randint(0, V, (2, 17))
    with torch.no_grad():
        ref = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, ref, atol=1e-5, rtol=1e-5)
        cache = ours.new_cache()
        steps = [ours(x[:, :9], cache=cache).logits]
        steps += [ours(x[:, t : t + 1], cache=cache).logits for t in range(9, 17)]
        torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=1e-5)
        mask = torch.ones_like(x)
        mask[1, :6] = 0  # left padding, positions 0..T-1 on both sides (HF's default)
        ref = hf_model(x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)


def test_attention_weights_equal_hugging_faces():
    cfg, hf_model = _hf_model(2)
    ours = lmlab_from_hf(cfg, hf_model)
    x = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        ref = hf_model(x, output_attentions=True).attentions
        got = ours(x, need_weights=True).attentions
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- config rules


@pytest.mark.parametrize(
    ("attention", "field"),
    [
        ({"n_kv_heads": 1}, "model.attention.n_kv_heads"),
        ({"n_heads": 2, "n_kv_heads": 1}, "model.attention.n_kv_heads"),
        ({"dropout": 0.1}, "model.attention.dropout"),
        ({"lambda_std_dev": -1.0}, "model.attention.lambda_std_dev"),
    ],
)
def test_check_refuses_what_the_two_maps_cannot_split(attention: dict, field: str):
    with pytest.raises(ConfigError, match=field):
        diff_config(**attention)


def test_odd_heads_refused_by_name():
    with pytest.raises(ConfigError, match="model.attention.n_heads must be even"):
        model = {"d_model": 48, "attention": {"n_heads": 3, "kind": "differential"}}
        validate_run_config(config_from_dict({"model": model}))


def test_lambda_std_dev_is_its_own_field():
    """Read by differential (the init std of the lambda vectors), refused on softmax."""
    torch.manual_seed(0)
    attn = build_model(diff_config(lambda_std_dev=0.0)).layers[0].attn
    assert torch.all(attn.lambda_q1 == 0) and torch.all(attn.lambda_k2 == 0)
    with pytest.raises(ConfigError, match="lambda_std_dev"):
        validate_run_config(config_from_dict({"model": {"attention": {"lambda_std_dev": 0.2}}}))


def test_preset_config_is_accepted():
    from lmlab.config import load_config

    run = load_config("configs/diff.yaml")
    assert run.model.attention.kind == "differential"


# ----------------------------------------------------------------------------- import, export


@pytest.mark.parametrize("tied", [False, True])
def test_load_a_diffllama_folder(tmp_path, tied: bool):
    """``lmlab.load`` of a saved DiffLlamaForCausalLM folder: equal logits (1e-5)."""
    import lmlab
    from tests.helpers import write_hf_folder

    _, hf_model = _hf_model(2, tied=tied)
    model, tokenizer = lmlab.load(write_hf_folder(tmp_path, hf_model))
    assert tokenizer is None and model.cfg.attention.kind == "differential"
    x = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf_model(x).logits, atol=1e-5, rtol=1e-5)


def test_export_map_is_the_inverse_of_the_import_map():
    from lmlab.interop.families import HF_FAMILIES, match_family

    cfg, hf_model = _hf_model(2)
    ours = lmlab_from_hf(cfg, hf_model)
    family, kwargs = match_family(ours.cfg)
    assert family is HF_FAMILIES.get("diffllama") and kwargs["num_key_value_heads"] == 2
    back = family.from_state(ours.state_dict(), ours.cfg)
    ref = hf_model.state_dict()
    assert back.keys() == ref.keys()
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_verify_runs_the_diffllama_reference_on_the_preset():
    pytest.importorskip("transformers")
    from lmlab.analysis.verify import check_reference
    from lmlab.config import load_config

    cfg = load_config("configs/diff.yaml").model
    cfg.vocab_size = V
    ok, detail = check_reference(cfg, torch.randint(0, V, (2, 12)))
    assert ok is True, detail
    assert "DiffLlamaForCausalLM" in detail
