"""Closed-form parameter counts equal built models, and the real published sizes."""

from pathlib import Path

import pytest

from lmlab.analysis.params import count_params
from lmlab.config import load_config
from lmlab.models import build_model
from tests.helpers import tiny_model_config
from tests.unit.test_model import IDS, VARIANTS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
