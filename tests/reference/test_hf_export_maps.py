"""lmlab -> Hugging Face state-dict maps are exact inverses of the HF -> lmlab maps.

Each test builds a tiny Hugging Face model with random weights (nothing downloaded), converts its
state dict HF -> lmlab (loading it into an lmlab model, strict) -> HF, and requires every tensor
HF's state dict holds to come back bit for bit; a fresh HF model loading the round-tripped dict
(strict) gives exactly the original's logits. The export tests start from lmlab instead.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab.errors import LmlabError  # noqa: E402
from lmlab.interop.families import HF_FAMILIES  # noqa: E402
from lmlab.interop.hf import (  # noqa: E402
    gpt2_hf_state_dict,
    gpt2_model_config,
    gpt2_state_dict,
    llama_model_config,
    llama_state_dict,
)
from lmlab.interop.hf_mistral import to_hf_state_dict  # noqa: E402
from lmlab.interop.hf_neox import (  # noqa: E402
    fuse_neox_qkv,
    neox_hf_state_dict,
    neox_model_config,
    neox_state_dict,
    split_neox_qkv,
)
from lmlab.models import build_model  # noqa: E402
from tests.helpers import perturb_all, tiny_model_config  # noqa: E402

VOCAB = 61


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter (norm weights start at 1, biases at 0) so no map can hide."""
    return perturb_all(model).eval()


def _persistent_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without non-persistent buffers (which state_dict() leaves out)."""
    non_persistent = {
        f"{name}.{buf}" if name else buf
        for name, module in model.named_modules()
        for buf in module._non_persistent_buffers_set
    }
    return {k: v for k, v in model.state_dict().items() if k not in non_persistent}


def _assert_round_trip(hf_model: torch.nn.Module, back: dict[str, torch.Tensor]) -> None:
    """``back`` holds exactly HF's keys with equal tensors, and a fresh model loading it
    (strict) computes the original's logits exactly, also on a left-padded batch."""
    ref = _persistent_state(hf_model)
    assert back.keys() == ref.keys()
    for key, value in ref.items():
        assert back[key].shape == value.shape and torch.equal(back[key], value), key
    torch.manual_seed(123)  # a fresh model with other random weights
    fresh = type(hf_model)(hf_model.config).eval()
    assert not torch.equal(next(fresh.parameters()), next(hf_model.parameters()))
    fresh.load_state_dict(back, strict=True)
    x = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(fresh(x, **kwargs).logits, hf_model(x, **kwargs).logits)


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_inner=80,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return _randomise(transformers.GPT2LMHeadModel(cfg))


def test_gpt2_round_trips_hf_to_lmlab_to_hf():
    hf_model = _gpt2()
    ours = build_model(gpt2_model_config(hf_model.config)).eval()
    ours.load_state_dict(gpt2_state_dict(hf_model.state_dict(), 48), strict=True)
    back = gpt2_hf_state_dict(ours.state_dict(), ours.cfg)
    # c_attn is the Conv1D (in, out) = (D, 3D) matrix, q | k | v along the output dim
    assert back["transformer.h.0.attn.c_attn.weight"].shape == (48, 144)
    assert torch.equal(
        back["transformer.h.1.attn.c_attn.weight"][:, 48:96].t(),
        ours.state_dict()["layers.1.attn.k_proj.weight"],
    )
    _assert_round_trip(hf_model, back)


def _neox(tied: bool, parallel: bool, rotary_pct: float) -> torch.nn.Module:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=72,
        max_position_embeddings=32,
        rotary_pct=rotary_pct,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": rotary_pct,
        },
        use_parallel_residual=parallel,
        tie_word_embeddings=tied,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return _randomise(transformers.GPTNeoXForCausalLM(cfg))


@pytest.mark.parametrize(
    ("tied", "parallel", "rotary_pct"),
    [(False, True, 0.25), (True, False, 1.0)],
    ids=["pythia-like", "tied-sequential"],
)
def test_neox_round_trips_hf_to_lmlab_to_hf(tied: bool, parallel: bool, rotary_pct: float):
    hf_model = _neox(tied, parallel, rotary_pct)
    assert bool(hf_model.config.tie_word_embeddings) == tied
    ours = build_model(neox_model_config(hf_model.config)).eval()
    ours.load_state_dict(neox_state_dict(hf_model.state_dict(), 4, tied), strict=True)
    back = neox_hf_state_dict(ours.state_dict(), ours.cfg)
    _assert_round_trip(hf_model, back)


def test_neox_qkv_is_fused_per_head_not_as_q_k_v_blocks():
    q, k, v = (torch.randn(12, 5) + i for i in range(3))  # 4 heads of 3 rows
    fused = fuse_neox_qkv(q, k, v, n_heads=4)
    assert torch.equal(fused[:9], torch.cat([q[:3], k[:3], v[:3]]))  # head 0: q_0, k_0, v_0
    assert not torch.equal(fused, torch.cat([q, k, v]))
    assert all(torch.equal(a, b) for a, b in zip(split_neox_qkv(fused, 4), (q, k, v), strict=True))
    bias = fuse_neox_qkv(q[:, 0], k[:, 0], v[:, 0], n_heads=4)
    assert torch.equal(bias, fused[:, 0])


def _llama(tied: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return _randomise(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_round_trips_hf_to_lmlab_to_hf(tied: bool):
    hf_model = _llama(tied)
    ours = build_model(llama_model_config(hf_model.config)).eval()
    ours.load_state_dict(llama_state_dict(hf_model.state_dict(), tied), strict=True)
    # tied=False: the in-memory layout, lm_head included (it is the embedding when tied)
    _assert_round_trip(hf_model, to_hf_state_dict(ours.state_dict(), tied=False))
    # tied=True: the on-disk layout, where HF leaves the tied head out
    on_disk = to_hf_state_dict(ours.state_dict(), tied=True)
    if tied:
        assert on_disk.keys() == hf_model.state_dict().keys() - {"lm_head.weight"}


@pytest.mark.parametrize(
    ("family", "overrides", "export"),
    [
        (
            "gpt2",
            {
                "position": {"kind": "learned"},
                "attention": {"n_heads": 4, "bias": True},
                "ffn": {"kind": "mlp", "activation": "gelu_tanh", "bias": True},
            },
            gpt2_hf_state_dict,
        ),
        ("gpt_neox", {}, neox_hf_state_dict),  # the tiny Mini-GPT: LayerNorm, RoPE, GELU
    ],
)
def test_an_lmlab_model_exports_to_hf_with_equal_logits(family, overrides, export):
    torch.manual_seed(0)
    ours = _randomise(build_model(tiny_model_config(VOCAB, **overrides)))
    fam = HF_FAMILIES.get(family)
    assert fam.from_config is not None
    hf_cfg = getattr(transformers, fam.hf_config_class)(**fam.from_config(ours.cfg))
    hf_model = getattr(transformers, fam.hf_class)(hf_cfg).eval()
    hf_model.load_state_dict(export(ours.state_dict(), ours.cfg), strict=True)
    x = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, ours(x).logits, atol=1e-5, rtol=1e-5)


def test_export_refuses_weights_the_family_has_no_place_for():
    swiglu = build_model(tiny_model_config(VOCAB, ffn={"kind": "swiglu", "bias": False}))
    with pytest.raises(LmlabError, match="'layers.0.ffn.gate_proj.weight' has no GPT-2"):
        gpt2_hf_state_dict(swiglu.state_dict(), swiglu.cfg)
    with pytest.raises(LmlabError, match="has no GPT-NeoX counterpart"):
        neox_hf_state_dict(swiglu.state_dict(), swiglu.cfg)
    gqa = build_model(tiny_model_config(VOCAB, attention={"n_heads": 4, "n_kv_heads": 2}))
    for export in (gpt2_hf_state_dict, neox_hf_state_dict):
        with pytest.raises(LmlabError, match="no grouped-query attention"):
            export(gqa.state_dict(), gqa.cfg)
