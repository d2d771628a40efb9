"""Closed-form parameter counts equal built models, and the real published sizes."""

from pathlib import Path

import pytest

from lmlab.analysis.contract import cases
from lmlab.analysis.params import count_params
from lmlab.config import load_config
from lmlab.models import build_model
from tests.helpers import tiny_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Every variant example the registries declare, on a decoder (the contract's cases; no list here)
DECODER_CASES = [c for c in cases() if c.kind == "decoder"]
IDS = [c.label for c in DECODER_CASES]
VARIANTS = [c.model for c in DECODER_CASES]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_count_equals_the_built_model_for_every_variant(variant):
    cfg = tiny_model_config(vocab_size=37, **variant)
    assert count_params(cfg)["total"] == build_model(cfg).num_params()
    assert count_params(cfg)["non_embedding"] == build_model(cfg).num_params(non_embedding=True)


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_count_equals_the_built_model_for_every_preset(preset):
    cfg = load_config(CONFIGS / f"{preset}.yaml").model
    cfg.vocab_size = 2048
    assert count_params(cfg)["total"] == build_model(cfg).num_params()


def _real(preset: str, overrides: list[str]) -> int:
    cfg = load_config(CONFIGS / f"{preset}.yaml", overrides).model
    return count_params(cfg)["total"]


def test_real_sizes_match_the_published_models_without_building_them():
    gpt2 = [
        "model.d_model=768",
        "model.n_layers=12",
        "model.attention.n_heads=12",
        "model.max_seq_len=1024",
        "model.vocab_size=50257",
    ]
    assert _real("gpt2-small", gpt2) == 124_439_808  # GPT-2 small
    llama3 = [
        "model.d_model=4096",
        "model.n_layers=32",
        "model.attention.n_heads=32",
        "model.attention.n_kv_heads=8",
        "model.ffn.d_ff=14336",
        "model.max_seq_len=8192",
        "model.vocab_size=128256",
    ]
    assert _real("llama", llama3) == 8_030_261_248  # Llama-3-8B
    # Mistral-7B and Mixtral-8x7B share one attention/width shape; Mixtral's FFN is 8 experts
    shape_7b = [
        "model.d_model=4096",
        "model.n_layers=32",
        "model.attention.n_heads=32",
        "model.attention.n_kv_heads=8",
        "model.ffn.d_ff=14336",
        "model.max_seq_len=32768",
        "model.vocab_size=32000",
    ]
    assert _real("mistral", [*shape_7b, "model.attention.window=4096"]) == 7_241_732_096
    assert _real("mixtral", shape_7b) == 46_702_792_704  # Mixtral-8x7B
    pythia = [
        "model.d_model=768",
        "model.n_layers=12",
        "model.attention.n_heads=12",
        "model.max_seq_len=2048",
        "model.vocab_size=50304",
    ]
    assert _real("neox", pythia) == 162_322_944  # Pythia-160m


def test_gpt2_small_by_part_equals_a_hand_count():
    cfg = load_config(
        CONFIGS / "gpt2-small.yaml",
        [
            "model.d_model=768",
            "model.n_layers=12",
            "model.attention.n_heads=12",
            "model.max_seq_len=1024",
            "model.vocab_size=50257",
        ],
    ).model
    d, f, L = 768, 3072, 12
    parts = count_params(cfg)
    assert parts == {
        "embedding": 50257 * d,
        "position": 1024 * d,
        "attention": L * (4 * d * d + 4 * d),  # q, k, v, o with biases
        "ffn": L * (2 * d * f + f + d),  # up and down with biases
        "norms": (2 * L + 1) * 2 * d,  # two LayerNorms a block + the final one
        "lm_head": 0,  # tied: the embedding, counted once
        "total": 124_439_808,
        "non_embedding": 124_439_808 - 50257 * d,
    }


def test_a_70b_model_is_counted_on_the_meta_device_without_storage():
    """Llama-3-70B's shape: every parameter and buffer of the counted model is a meta tensor
    (no storage), and the count is the published 70,553,706,496."""
    from lmlab.models.counting import meta_model

    llama70b = [
        "model.d_model=8192",
        "model.n_layers=80",
        "model.attention.n_heads=64",
        "model.attention.n_kv_heads=8",
        "model.ffn.d_ff=28672",
        "model.max_seq_len=8192",
        "model.vocab_size=128256",
    ]
    cfg = load_config(CONFIGS / "llama.yaml", llama70b).model
    assert count_params(cfg)["total"] == 70_553_706_496
    model = meta_model(cfg)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
