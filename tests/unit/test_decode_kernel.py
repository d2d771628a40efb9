"""The one-call C++ decode step (lmlab.nn.decode_kernel, taken by lmlab.generation.lean_step)
computes what the model's forward computes, to float32 rounding, writes the same KV cache,
and stands aside (the Python loop runs, bit-equal to the forward) wherever it does not apply.

Tolerances: float32 logits within 1e-4 absolute of the forward's (logits are O(1) here: the
tiny models get unit-gain random weights so that attention is far from uniform and a wrong
head, position or norm shows); the measured differences are ~1e-6."""

from __future__ import annotations

import pytest
import torch

from lmlab.generation import lean_step
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.generation.lean_step import LeanStep
from lmlab.models.decoder import DecoderLM
from lmlab.nn import cpp_build, decode_kernel
from lmlab.nn.decode_kernel import Plan
from lmlab.nn.quant import apply_quantization
from tests.helpers import tiny_model_config
from tests.helpers.kernels import require_quant_kernels
from tests.helpers.lean import LLAMA, lean_beside_the_forward, unit_gain_

MINIGPT = {  # configs/minigpt.yaml's architecture
    "norm": {"kind": "layernorm", "bias": True},
    "ffn": {"kind": "mlp", "activation": "gelu", "bias": True},
    "position": {"kind": "rope"},
    "tie_embeddings": False,
}
CONFIGS = {
    "llama_gqa": LLAMA,
    "llama_biases_untied": {
        **LLAMA,
        "attention": {"n_heads": 6, "n_kv_heads": 3, "bias": True},
        "ffn": {"kind": "swiglu", "bias": True},
        "tie_embeddings": False,
    },
    "minigpt": MINIGPT,
    "minigpt_attn_bias_tied": {
        **MINIGPT,
        "attention": {"n_heads": 4, "bias": True},
        "tie_embeddings": True,
    },  # fmt: skip
    "gelu_tanh_nobias_layernorm": {
        "norm": {"kind": "layernorm", "bias": False},
        "ffn": {"kind": "mlp", "activation": "gelu_tanh", "bias": False},
        "position": {"kind": "rope"},
    },
    "relu_learned_positions": {
        "ffn": {"kind": "mlp", "activation": "relu"},
        "position": {"kind": "learned"},
    },  # fmt: skip
    "rope_linear_scaling": {
        **LLAMA,
        "position": {"kind": "rope", "scaling": {"kind": "linear", "factor": 4.0}},
    },
    "rope_dynamic_ntk": {  # length-dependent: cos / sin per step (no table); 5 + 6 > 7
        **LLAMA,
        "position": {
            "kind": "rope",
            "scaling": {"kind": "dynamic_ntk", "factor": 3.0, "original_max_seq_len": 7},
        },
    },
    "silu_mlp": {"ffn": {"kind": "mlp", "activation": "silu"}, "position": {"kind": "rope"}},
    "geglu_mqa": {**LLAMA, "ffn": {"kind": "geglu"}, "attention": {"n_heads": 6, "n_kv_heads": 1}},
}
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _kernels(request: pytest.FixtureRequest) -> None:
    require_quant_kernels(request)
    decode_kernel._reset()
    assert decode_kernel.available(), decode_kernel.status()
    request.addfinalizer(decode_kernel._reset)


def _model(name: str, seed: int = 0, **extra: object) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = tiny_model_config(vocab_size=40, **{**CONFIGS[name], **extra})
    return unit_gain_(DecoderLM(cfg).eval())  # type: ignore[return-value]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count C++ steps (rows per call)."""
    calls: list[int] = []
    real = Plan.run

    def counted(self: Plan, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Plan, "run", counted)
    return calls


def _decode(model: DecoderLM, prompt: torch.Tensor, steps: int, capacity: int, cpp: bool = True):
    """Greedy decode ``steps`` tokens from ``prompt`` twice: through a LeanStep (the C++ step
    when ``cpp``, else its Python loop) and through the model's forward, each feeding the
    forward's argmax (so both see the same tokens); returns (lean logits, forward logits,
    the lean cache, the forward cache, the LeanStep)."""
    with torch.no_grad():
        ref_cache, cache = model.new_cache(), model.new_cache()
        model(prompt, cache=ref_cache, last_only=True)
        out = model(prompt, cache=cache, last_only=True).logits
        lean = LeanStep(model, cache, capacity)
        x = out[:, -1:].argmax(-1)
        mine, refs = [], []
        for _ in range(steps):
            if cpp:
                mine.append(lean(x))
            else:
                with decode_kernel.disabled():
                    mine.append(lean(x))
            refs.append(model(x, cache=ref_cache, last_only=True).logits)
            x = refs[-1].argmax(-1)
    return mine, refs, cache, ref_cache, lean


def test_gemv_equals_torch_for_every_row_count_and_ragged_widths() -> None:
    torch.manual_seed(0)
    for m in range(1, 9):
        for n, k in ((37, 576), (960, 576), (11, 77), (9, 16), (5, 3)):
            x, w = torch.randn(m, k), torch.randn(n, k)
            torch.testing.assert_close(decode_kernel.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        decode_kernel.gemv(torch.randn(9, 4), torch.randn(3, 4))  # more than 8 rows


def test_the_steps_silu_matches_torch_across_the_range_and_keeps_nan() -> None:
    g = torch.cat([torch.linspace(-120, 120, 2001), torch.randn(1000) * 4, torch.zeros(3)])
    u = torch.randn_like(g)
    torch.testing.assert_close(decode_kernel.silu_mul(g), torch.nn.functional.silu(g),
                               rtol=2e-6, atol=1e-30)  # fmt: skip
    torch.testing.assert_close(decode_kernel.silu_mul(g, u), torch.nn.functional.silu(g) * u,
                               rtol=2e-6, atol=1e-30)  # fmt: skip
    odd = torch.tensor([float("nan"), 1.0, -1.0, float("inf"), 3.0, 0.5, 2.0, 7.0, float("nan")])
    got = decode_kernel.silu_mul(odd)  # the vector lanes and the scalar tail
    assert torch.isnan(got[0]) and torch.isnan(got[8]) and got[3] == float("inf")
    torch.testing.assert_close(got[1:8], torch.nn.functional.silu(odd[1:8]), rtol=2e-6, atol=0)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpp_step_logits_equal_the_forward_and_the_python_loop(
    name: str, b: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(name)
    calls = _spy(monkeypatch)
    prompt = torch.randint(0, 40, (b, 5))
    mine, refs, *_, lean = _decode(model, prompt, steps=6, capacity=16)
    assert lean.cpp_refusal is None and calls == [b] * 6  # every step was the C++ call
    assert max((m - r).abs().max().item() for m, r in zip(mine, refs, strict=True)) > 0
    for m, r in zip(mine, refs, strict=True):
        assert m.shape == r.shape == (b, 1, 40)
        torch.testing.assert_close(m, r, rtol=0, atol=ATOL)
        assert torch.equal(m.argmax(-1), r.argmax(-1))
    python, *_ = _decode(model, prompt, steps=6, capacity=16, cpp=False)
    assert len(calls) == 6  # the C++ step was off for the second decode
    for m, p in zip(mine, python, strict=True):
        torch.testing.assert_close(m, p, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["llama_gqa", "minigpt"])
def test_greedy_decode_equals_full_recomputation_and_the_cache_equals_the_python_paths(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(name)
    calls = _spy(monkeypatch)
    prompt = [3, 1, 4, 1, 5]
    tokens = list(generate_ids(model, prompt, SamplingParams(10, temperature=0.0), 32))
    assert len(calls) == 9  # every step after the prefill
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():  # recomputation: each next token is the argmax of the full forward
        full = model(seq).logits[0]
    assert tokens == full[len(prompt) - 1 : -1].argmax(-1).tolist()
    # the logits of the last steps against the full forward's, and the cache contents
    p = torch.tensor([prompt])
    with torch.no_grad():
        cache = model.new_cache()
        model(p, cache=cache)
        lean = LeanStep(model, cache, 32)
        kbuf = cache.layers[0]._kbuf
        for i in range(len(tokens) - 1):  # token i in, the logits that chose token i + 1 out
            got = lean(torch.tensor([[tokens[i]]]))
            torch.testing.assert_close(got[0, 0], full[len(prompt) + i], rtol=0, atol=ATOL)
            assert got.argmax().item() == tokens[i + 1]
    assert cache.layers[0]._kbuf is kbuf  # written in place, no reallocation
    _, _, py_cache, _, _ = _decode(model, p, steps=len(tokens) - 1, capacity=32, cpp=False)
    assert cache.seq_len == py_cache.seq_len == len(prompt) + len(tokens) - 1
    for mine, ref in zip(cache.layers, py_cache.layers, strict=True):
        assert mine.k.shape == ref.k.shape and mine.k._base is mine._kbuf
        torch.testing.assert_close(mine.k, ref.k, rtol=0, atol=1e-5)
        torch.testing.assert_close(mine.v, ref.v, rtol=0, atol=1e-5)


def test_a_full_cache_grows_through_the_python_step_and_the_cpp_step_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    # capacity 8: prompt 5 + 3 steps fill it, the 4th grows the buffers in Python
    mine, refs, cache, _, _ = _decode(model, torch.randint(0, 40, (2, 5)), steps=8, capacity=8)
    assert len(calls) == 7 and cache.seq_len == 13  # one step (the growing one) ran in Python
    for m, r in zip(mine, refs, strict=True):
        torch.testing.assert_close(m, r, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spec", ["int8", "int4", "int8+a8", "int4+a8", "int4:16"])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", ["llama_biases_untied", "minigpt"])
def test_a_quantized_model_steps_as_its_python_lean_path(
    spec: str, b: int, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same quantized kernels on the same operands: only the float glue differs, so the
    logits agree within 1e-4. With int8 activations (+a8) a float32 rounding difference in the
    glue can move one activation across a rounding boundary (measured: 1e-6 typically, 3e-2
    after such a flip, against 3e-2..5e-2 for rounding the activations at all): there most
    steps must agree within 1e-4 and every step within 0.1."""
    model = apply_quantization(_model(name, d_model=96), spec)
    calls = _spy(monkeypatch)
    prompt = torch.randint(0, 40, (b, 5))
    mine, refs, *_, lean = _decode(model, prompt, steps=5, capacity=16)
    assert lean.cpp_refusal is None and lean.plan_quant and calls == [b] * 5
    python, *_ = _decode(model, prompt, steps=5, capacity=16, cpp=False)
    diffs = [(m - p).abs().max().item() for m, p in zip(mine, python, strict=True)]
    diffs += [(m - r).abs().max().item() for m, r in zip(mine, refs, strict=True)]
    if "a8" in spec:
        assert sum(d <= ATOL for d in diffs) > len(diffs) / 2 and max(diffs) < 0.1, diffs
    else:
        assert max(diffs) <= ATOL, diffs


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("spec", ["int8", "int4", "int4+a8"])
@pytest.mark.parametrize("b", [1, 3])
def test_quantized_layers_split_over_row_ranges_give_the_kernels_numbers(
    spec: str, b: int, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers of >= 128 KiB of codes run as several kernel calls on row ranges (threads):
    here gate/up, down and the int8 q/k/v are that big; the logits stay the Python loop's
    (and with SPLIT_QUANTIZED off, one call each)."""
    monkeypatch.setattr(decode_kernel, "SPLIT_QUANTIZED", split)
    model = apply_quantization(_model("llama_biases_untied", d_model=288), spec)
    gate = model.layers[0].ffn.gate_proj
    assert 2 * gate.qweight.nbytes >= 1 << 17  # the fused gate/up: split
    calls = _spy(monkeypatch)
    prompt = torch.randint(0, 40, (b, 5))
    mine, *_ = _decode(model, prompt, steps=4, capacity=16)
    python, *_ = _decode(model, prompt, steps=4, capacity=16, cpp=False)
    assert calls == [b] * 4
    diffs = [(m - p).abs().max().item() for m, p in zip(mine, python, strict=True)]
    if "a8" in spec:
        assert sum(d <= ATOL for d in diffs) > len(diffs) / 2 and max(diffs) < 0.1, diffs
    else:
        assert max(diffs) <= ATOL, diffs


@pytest.mark.parametrize("limit", ["avx2", "generic"])
def test_the_avx2_and_plain_loop_builds_step_as_the_forward(
    limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 + FMA build (8-wide products, scalar tails) and the build without instruction-set
    flags (plain loops) give the forward's logits too, float32 and quantized."""
    try:
        lib = decode_kernel._build(limit)
    except Exception as e:  # pragma: no cover - no compiler for this variant
        pytest.skip(f"cannot build the {limit} variant: {e}")
    avx2 = limit == "avx2" and cpp_build.cpu_has_avx2_fma()
    assert lib.lmlab_decode_simd() == (256 if avx2 else 0)
    monkeypatch.setattr(decode_kernel._lib, "lib", lib)
    torch.manual_seed(0)
    x, w = torch.randn(3, 77), torch.randn(50, 77)
    torch.testing.assert_close(decode_kernel.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    g = torch.linspace(-30, 30, 203)
    torch.testing.assert_close(decode_kernel.silu_mul(g), torch.nn.functional.silu(g),
                               rtol=2e-6, atol=1e-30)  # fmt: skip
    calls = _spy(monkeypatch)
    for model in (_model("llama_gqa"), apply_quantization(_model("minigpt", d_model=96), "int4")):
        mine, refs, *_ = _decode(model, torch.randint(0, 40, (3, 5)), steps=4, capacity=16)
        for m, r in zip(mine, refs, strict=True):
            torch.testing.assert_close(m, r, rtol=0, atol=ATOL)
    assert calls == [3] * 8


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"attention": {"n_heads": 6, "n_kv_heads": 2, "qk_norm": True}}, "normalizes"),
        ({"position": {"kind": "rope", "interleaved": True}}, "rotation"),
        ({"position": {"kind": "rope", "partial_rotary_factor": 0.5}}, "rotation"),
    ],
)
def test_models_it_does_not_compute_fall_back_to_the_python_loop(
    extra: dict, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model("llama_gqa", **extra)
    calls = _spy(monkeypatch)
    mine, refs, *_, lean = _decode(model, torch.randint(0, 40, (1, 4)), steps=3, capacity=16)
    assert calls == [] and reason in (lean.cpp_refusal or "")
    for m, r in zip(mine, refs, strict=True):
        assert torch.equal(m, r)  # the Python loop: bit for bit


def test_more_than_eight_rows_step_through_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    mine, refs, *_ = _decode(model, torch.randint(0, 40, (9, 4)), steps=2, capacity=16)
    assert calls == []
    for m, r in zip(mine, refs, strict=True):
        assert torch.equal(m, r)
    mine, refs, *_ = _decode(model, torch.randint(0, 40, (8, 4)), steps=2, capacity=16)
    assert calls == [8, 8]
    for m, r in zip(mine, refs, strict=True):
        torch.testing.assert_close(m, r, rtol=0, atol=ATOL)


def test_a_bfloat16_model_is_refused_and_steps_as_its_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("llama_gqa").to(torch.bfloat16)
    calls = _spy(monkeypatch)
    mine, refs, *_, lean = _decode(model, torch.randint(0, 40, (1, 4)), steps=3, capacity=16)
    assert calls == [] and "float32" in (lean.cpp_refusal or "")
    for m, r in zip(mine, refs, strict=True):
        assert torch.equal(m, r)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_switched_off_the_python_loop_runs_bit_equal_to_the_forward(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "flag":
        monkeypatch.setattr(decode_kernel, "ENABLED", False)
    else:
        monkeypatch.setenv("LMLAB_NO_CPP_KERNELS", "1")
        decode_kernel._reset()
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    mine, refs, *_ = _decode(model, torch.randint(0, 40, (1, 4)), steps=3, capacity=16)
    assert calls == [] and not decode_kernel.available()
    for m, r in zip(mine, refs, strict=True):
        assert torch.equal(m, r)


def test_weights_changed_between_steps_are_seen_by_the_cpp_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("minigpt")
    calls = _spy(monkeypatch)
    lean, ref_cache = lean_beside_the_forward(model)
    with torch.no_grad():
        model.layers[1].ffn.down_proj.weight.mul_(3.0)  # in place
        model.layers[0].attn.q_proj.weight = torch.nn.Parameter(
            model.layers[0].attn.q_proj.weight * 0.5
        )  # replaced
        model.layers[0].ffn_norm.bias.add_(1.0)
        got = lean(torch.tensor([[2]]))
        want = model(torch.tensor([[2]]), cache=ref_cache, last_only=True).logits
    assert calls == [1, 1]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_generation_with_a_hook_runs_the_forward_not_the_cpp_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lmlab.hooks import hooks

    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    seen: list[int] = []
    with hooks(model, [("layers.0.hook_resid_post", lambda x, name: seen.append(x.shape[1]))]):
        hooked = list(generate_ids(model, [1, 2, 3], SamplingParams(4, temperature=0.0), 32))
    assert calls == [] and seen == [3, 1, 1, 1]
    plain = list(generate_ids(model, [1, 2, 3], SamplingParams(4, temperature=0.0), 32))
    assert len(calls) == 3 and plain == hooked
    monkeypatch.setattr(lean_step, "ENABLED", False)
    assert list(generate_ids(model, [1, 2, 3], SamplingParams(4, temperature=0.0), 32)) == plain
