"""FLOPs, KV-cache bytes and parameter breakdowns equal hand counts, built models, real caches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.analysis import costs
from lmlab.analysis.contract import cases
from lmlab.analysis.inspection import inspect_model
from lmlab.analysis.params import count_params
from lmlab.config import AttentionConfig, FFNConfig, ModelConfig, load_config
from lmlab.errors import ConfigError
from lmlab.models import build_model
from lmlab.nn import ATTENTION, MASKS
from lmlab.training import flops as train_flops
from tests.helpers import tiny_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MiB = 2**20

# Every variant example the registries declare, on a decoder (the contract's cases; no list here)
DECODER_CASES = [c for c in cases() if c.kind == "decoder"]
IDS = [c.label for c in DECODER_CASES]
VARIANTS = [c.model for c in DECODER_CASES]


def track_step_bytes(cache) -> dict[int, int]:
    """Layer index -> bytes its attention read from the cache in the latest step: the keys and
    values the cache handed it (a sliding window: the kept ones and the new ones), or the
    recurrent state it holds (linear attention). Wraps each layer cache's ``update``."""
    held: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):

        def update(*args, _update=layer.update, _i=i, _layer=layer, **kwargs):
            out = _update(*args, **kwargs)
            kv = () if out is None else out
            held[_i] = sum(t.numel() * t.element_size() for t in kv) if kv else _layer.nbytes()
            return out

        layer.update = update
    return held


def _big(n_kv_heads: int, **model: object) -> ModelConfig:
    """Llama-2-7B's attention shape: 32 layers, d 4096, 32 heads of 128 dims (not built)."""
    attn = AttentionConfig(n_heads=32, n_kv_heads=n_kv_heads)
    return ModelConfig(d_model=4096, n_layers=32, vocab_size=32000, attention=attn, **model)  # type: ignore[arg-type]


def test_four_attention_projections_of_d512_h8_hold_4_d_squared_weights(tmp_path: Path):
    cfg_file = tmp_path / "m.yaml"
    cfg_file.write_text(
        "model: {d_model: 512, n_layers: 1, vocab_size: 100, attention: {n_heads: 8}}\n"
    )
    info = inspect_model(cfg_file)
    c = info["components"]
    assert c["attention_q"] == c["attention_k"] == c["attention_v"] == c["attention_o"]
    qkvo = c["attention_q"] + c["attention_k"] + c["attention_v"] + c["attention_o"]
    assert qkvo == 4 * 512 * 512 == 1_048_576
    assert sum(c.values()) == info["params_total"]


def test_kv_cache_32_heads_4096_tokens_128_dims_bf16_is_64_mib_per_layer():
    cfg = _big(n_kv_heads=32)
    assert costs.kv_cache_bytes_per_token(cfg, 2) == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers
    per_layer = costs.kv_cache_bytes(cfg, batch=1, context=4096, dtype_bytes=2) // cfg.n_layers
    assert per_layer == 32 * 4096 * 128 * 2 * 2 == 64 * MiB
    assert costs.kv_cache_bytes(cfg, 8, 4096, 2) == 8 * 32 * 64 * MiB  # batch and layers multiply


@pytest.mark.parametrize(("n_kv_heads", "mib"), [(32, 64), (8, 16), (4, 8), (1, 2)])
def test_gqa_and_mqa_shrink_the_cache_by_n_heads_over_n_kv_heads(n_kv_heads: int, mib: int):
    cfg = _big(n_kv_heads)
    assert costs.kv_cache_bytes(cfg, 1, 4096, 2) // 32 == mib * MiB == 64 * MiB * n_kv_heads // 32


def test_the_cache_formula_equals_what_a_real_cache_holds():
    cfg = tiny_model_config(vocab_size=37, attention={"n_heads": 4, "n_kv_heads": 2})
    model = build_model(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 37, (3, 20)), cache=cache)
    assert cache.nbytes() == costs.kv_cache_bytes(cfg, 3, 20, 4) == 3 * 20 * 2 * 2 * 2 * 8 * 4


def test_a_sliding_window_bounds_the_cache_at_the_window():
    cfg = tiny_model_config(vocab_size=37, attention={"mask": "sliding_window", "window": 6})
    per_token = costs.kv_cache_bytes_per_token(cfg, 4)
    assert per_token == 2 * 2 * 4 * 8 * 4  # unchanged per token
    assert costs.kv_cache_bytes(cfg, 2, 30, 4) == costs.kv_cache_bytes(cfg, 2, 6, 4)
    assert costs.kv_cache_bytes(cfg, 2, 30, 4) == 2 * 6 * per_token
    assert costs.kv_cache_bytes(cfg, 2, 4, 4) == 2 * 4 * per_token  # below the window: grows
    model = build_model(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 30)), cache=cache)
    # between steps the real cache keeps window - 1 tokens; a step adds the new one (the bound)
    assert cache.nbytes() == 2 * 5 * per_token


def _kinds_by_masks() -> list[dict]:
    """Every registered attention kind with every registered mask it accepts (a window of 6
    where the mask needs one), 4 heads sharing 2 kv heads (or no n_kv_heads for a kind that has
    no kv heads of its own to set, MLA)."""
    out = []
    for kind in ATTENTION:
        for mask in MASKS:
            tries = [{**w, **kv} for kv in ({"n_kv_heads": 2}, {}) for w in ({}, {"window": 6})]
            for extra in tries:
                attn = {"kind": kind, "mask": mask, "n_heads": 4, **extra}
                try:
                    build_model(tiny_model_config(vocab_size=37, attention=attn))
                except ConfigError:
                    continue
                out.append(attn)
                break
    return out


KINDS_BY_MASKS = _kinds_by_masks()


def test_every_attention_kind_is_decoded_with_its_own_masks():
    kinds = {a["kind"] for a in KINDS_BY_MASKS}
    assert kinds == set(ATTENTION) and {a["mask"] for a in KINDS_BY_MASKS} == set(MASKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", KINDS_BY_MASKS, ids=str)
def test_declared_cache_bytes_equal_what_the_cache_holds_while_decoding(attn, dtype):
    cfg = tiny_model_config(vocab_size=37, attention=attn)
    model = build_model(cfg).eval().to(dtype)
    b = torch.finfo(dtype).bits // 8
    x = torch.randint(0, 37, (2, 14))
    cache = model.new_cache()
    held = track_step_bytes(cache)
    with torch.no_grad():
        model(x[:, :3], cache=cache)  # a prefill shorter than the window (it holds them all)
        assert sum(held.values()) == costs.kv_cache_bytes(cfg, 2, 3, b)
        for t in range(3, 14):  # then one token a step: the cache while decoding token t + 1
            model(x[:, t : t + 1], cache=cache)
            assert sum(held.values()) == costs.kv_cache_bytes(cfg, 2, t + 1, b), t
    # per token: what decoding one more token adds, until a bound (window, constant state)
    grown = costs.kv_cache_bytes(cfg, 2, 3, b) - costs.kv_cache_bytes(cfg, 2, 2, b)
    assert grown == 2 * costs.kv_cache_bytes_per_token(cfg, b)


def test_linear_attention_adds_nothing_per_token_and_keeps_a_constant_state():
    cfg = tiny_model_config(vocab_size=37, attention={"n_heads": 4, "kind": "linear"})
    assert costs.kv_cache_bytes_per_token(cfg) == 0
    state = 2 * 2 * 4 * (8 * 8 + 8) * 4  # batch 2, layers 2, 4 heads, (hd^2 + hd), fp32
    assert costs.kv_cache_bytes(cfg, 2, 10, 4) == costs.kv_cache_bytes(cfg, 2, 1000, 4) == state
    model = build_model(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 10)), cache=cache)
    assert cache.nbytes() == state


def test_flops_per_token_equals_a_hand_count():
    cfg = tiny_model_config(vocab_size=100, d_model=64, attention={"n_heads": 4})
    # N: 2 layers x (q, k, v, o: 4 x 64 x 64 + MLP up and down: 2 x 64 x 256) + LM head 100 x 64
    n = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 100 * 64
    assert costs.matmul_params(cfg) == n == 104_704
    forward = 2 * n + 4 * 2 * 32 * 64  # + 4 L T (H hd) at T = 32
    assert costs.flops_per_token(cfg, 32) == forward == 225_792
    assert costs.flops_per_token(cfg, 32, train=True) == 3 * forward
    assert costs.flops_per_token(cfg, 64) - costs.flops_per_token(cfg, 32) == 4 * 2 * 32 * 64


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_flops_from_the_config_equal_the_trainers_count_on_the_built_model(variant):
    cfg = tiny_model_config(vocab_size=37, **variant)
    model = build_model(cfg)
    for train in (False, True):
        assert costs.flops_per_token(cfg, 24, train) == train_flops.flops_per_token(
            model, cfg, 24, train
        )


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_components_equal_the_built_models_tensors(variant):
    cfg = tiny_model_config(vocab_size=37, **variant)
    model = build_model(cfg)
    c = costs_components(cfg)
    assert sum(c.values()) == count_params(cfg)["total"] == model.num_params()
    for part in "qkvo":
        built = sum(p.numel() for n, p in model.named_parameters() if f".{part}_proj." in n)
        assert c[f"attention_{part}"] == built, part
    ffn = sum(p.numel() for n, p in model.named_parameters() if ".ffn." in n)
    assert c["ffn"] == ffn
    named = dict(model.named_parameters())  # tied weights once, under the embedding's name

    def size(keep) -> int:
        return sum(p.numel() for n, p in named.items() if keep(n))

    qkvo = tuple(f".{p}_proj." for p in "qkvo")
    own = c["attention_norms"] + c.get("attention_other", 0)  # a kind's own params (MLA, sinks)
    assert own == size(lambda n: ".attn." in n and not any(p in n for p in qkvo))
    if "attention_other" not in c:
        assert c["attention_norms"] == size(lambda n: ".attn." in n and "_norm." in n)
    assert c["norms"] == size(lambda n: ".attn." not in n and "norm." in n)
    assert c["position"] == size(lambda n: n.startswith("position."))
    assert c["embedding"] == named["embed.weight"].numel()
    assert c["lm_head"] == size(lambda n: n.startswith("lm_head."))


def costs_components(cfg: ModelConfig) -> dict[str, int]:
    from lmlab.analysis.inspection import components

    return components(cfg)


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_flops_equal_the_trainers_count_for_every_preset(preset):
    cfg = load_config(CONFIGS / f"{preset}.yaml").model
    cfg.vocab_size = 2048
    model = build_model(cfg)
    t = cfg.max_seq_len
    assert costs.flops_per_token(cfg, t) == train_flops.flops_per_token(model, cfg, t, False)


def test_moe_active_parameters_are_the_total_less_the_idle_experts():
    ffn = FFNConfig(kind="moe", n_experts=4, top_k=1, expert="swiglu", bias=False, d_ff=64)
    cfg = tiny_model_config(vocab_size=37)
    cfg.ffn = ffn
    expert = 3 * 32 * 64  # gate, up, down
    total = count_params(cfg)["total"]
    assert total == build_model(cfg).num_params()
    assert costs.active_params(cfg) == total - 2 * 3 * expert  # 2 layers x 3 idle experts
    # Mixtral-8x7B: 46.7B parameters, 12.9B active per token (Jiang et al. 2024)
    shape = [
        "model.d_model=4096",
        "model.n_layers=32",
        "model.attention.n_heads=32",
        "model.attention.n_kv_heads=8",
        "model.ffn.d_ff=14336",
        "model.vocab_size=32000",
    ]
    mixtral = load_config(CONFIGS / "mixtral.yaml", shape).model
    assert count_params(mixtral)["total"] == 46_702_792_704
    assert costs.active_params(mixtral) == 12_879_925_248


def test_training_memory_is_the_trainers_estimate_at_the_given_batch_and_length():
    from lmlab.config import RunConfig, TrainConfig
    from lmlab.training.memory import estimate_training_memory

    cfg = tiny_model_config(vocab_size=37)
    est = costs.training_memory(cfg, batch=3, seq_len=16)
    ref = estimate_training_memory(
        RunConfig(model=cfg, train=TrainConfig(batch_size=3, seq_len=16))
    )
    assert est == ref
    double = costs.training_memory(cfg, batch=6, seq_len=16)
    assert double.activations == 2 * est.activations and double.weights == est.weights


def test_dtype_names_give_their_element_size():
    assert [costs.dtype_bytes(n) for n in ("float32", "bf16", "FP16", "int8")] == [4, 2, 2, 1]
