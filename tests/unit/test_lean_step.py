"""The lean decode step (lmlab.generation.lean_step) computes what the model's forward computes,
stands aside where it does not apply, and never runs on stale weights or past a hook.

These tests pin its Python loop (bit-equal to the forward): the one-call C++ step
(lmlab.nn.decode_kernel, float32 rounding) is switched off here and tested in
tests/unit/test_decode_kernel.py."""

from __future__ import annotations

import pytest
import torch

from lmlab.generation import lean_step
from lmlab.generation.generate import SamplingParams, generate_batch, generate_ids
from lmlab.generation.lean_step import LeanStep, _QuantCat, lean_refusal
from lmlab.hooks import hooks
from lmlab.models.decoder import DecoderLM
from lmlab.nn import decode_kernel, quant_kernel
from lmlab.nn.kv_cache import KVCache
from lmlab.nn.quant import apply_quantization
from tests.helpers import tiny_model_config
from tests.helpers.lean import lean_beside_the_forward

LLAMA = {
    "norm": {"kind": "rmsnorm"},
    "ffn": {"kind": "swiglu", "bias": False},
    "position": {"kind": "rope"},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
}
CONFIGS = {
    "default": {},
    "llama_gqa": LLAMA,
    "mqa_bias": {**LLAMA, "attention": {"n_heads": 4, "n_kv_heads": 1, "bias": True}},
    "qk_norm_partial": {
        **LLAMA,
        "attention": {"n_heads": 4, "qk_norm": True},
        "position": {"kind": "rope", "partial_rotary_factor": 0.5},
    },
    "qk_norm_full_rotary": {**LLAMA, "attention": {"n_heads": 4, "qk_norm": True}},
    "interleaved": {**LLAMA, "position": {"kind": "rope", "interleaved": True}},
    "geglu_layernorm": {"ffn": {"kind": "geglu"}, "position": {"kind": "rope"}},
    "sinusoidal": {"position": {"kind": "sinusoidal"}},
    "learned_untied": {"position": {"kind": "learned"}, "tie_embeddings": False},
}


@pytest.fixture(autouse=True)
def _python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_kernel, "ENABLED", False)


def _model(name: str, seed: int = 0, **extra: object) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = tiny_model_config(vocab_size=40, **{**CONFIGS[name], **extra})
    return DecoderLM(cfg).eval()


def _lean_and_forward(model: DecoderLM, prompt: torch.Tensor, steps: int, capacity: int):
    """Decode ``steps`` tokens twice from the same prefill: the lean step and the forward,
    each feeding its own argmax; returns both logits lists."""
    with torch.no_grad():
        ref_cache, lean_cache = model.new_cache(), model.new_cache()
        model(prompt, cache=ref_cache, last_only=True)
        out = model(prompt, cache=lean_cache, last_only=True).logits
        assert lean_refusal(model, lean_cache) is None
        lean = LeanStep(model, lean_cache, capacity)
        x = out[:, -1:].argmax(-1)
        refs, leans = [], []
        for _ in range(steps):
            refs.append(model(x, cache=ref_cache, last_only=True).logits)
            leans.append(lean(x))
            x = leans[-1].argmax(-1)
    return refs, leans


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lean_logits_equal_the_forward_step_by_step(
    name: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lmlab.nn.fused.ENABLED", fused)
    model = _model(name)
    prompt = torch.randint(0, 40, (2, 5))  # two unpadded rows
    # capacity 8 < 5 + 6 steps: the last steps grow the cache past its reserved buffers
    refs, leans = _lean_and_forward(model, prompt, steps=6, capacity=8)
    for ref, lean in zip(refs, leans, strict=True):
        assert lean.shape == ref.shape == (2, 1, 40)
        assert torch.equal(lean, ref)  # bit for bit on one thread (OMP_NUM_THREADS=1 in tests)


@pytest.mark.parametrize("name", ["llama_gqa", "default"])
def test_a_bfloat16_model_steps_as_its_forward(name: str) -> None:
    model = _model(name).to(torch.bfloat16)
    refs, leans = _lean_and_forward(model, torch.randint(0, 40, (1, 5)), steps=4, capacity=16)
    for ref, lean in zip(refs, leans, strict=True):
        assert lean.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(lean, ref, rtol=0, atol=0)


def test_the_reserved_cache_is_written_in_place_and_equals_the_dynamic_one() -> None:
    model = _model("llama_gqa")
    prompt = torch.randint(0, 40, (1, 4))
    with torch.no_grad():
        cache = model.new_cache()
        model(prompt, cache=cache, last_only=True)
        lean = LeanStep(model, cache, 20)
        buf = cache.layers[0]._kbuf
        assert buf is not None and buf.shape[2] == 20  # reserved once, exactly
        for t in range(5):
            lean(torch.tensor([[t]]))
        assert cache.layers[0]._kbuf is buf and cache.seq_len == 9  # no reallocation
        full = model.new_cache()
        model(torch.cat([prompt, torch.arange(5)[None]], dim=1), cache=full)
    for mine, ref in zip(cache.layers, full.layers, strict=True):
        torch.testing.assert_close(mine.k, ref.k, rtol=0, atol=1e-6)
        torch.testing.assert_close(mine.v, ref.v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_gqa", "mqa_bias"])
@pytest.mark.parametrize("spec", ["int8", "int4:16", "int8+a8", "int4+a8", "int4:16+a8"])
def test_lean_step_of_a_quantized_model_equals_its_forward(spec: str, name: str) -> None:
    """Also with int8 activations (+a8: the integer kernels; group 16 their plain loops)."""
    model = apply_quantization(_model(name, d_model=64), spec)
    refs, leans = _lean_and_forward(model, torch.randint(0, 40, (1, 5)), steps=4, capacity=16)
    for ref, lean in zip(refs, leans, strict=True):
        assert torch.equal(lean, ref)
    if quant_kernel.available():  # q/k/v and gate/up ran as one kernel call each
        step = LeanStep(model, _prefilled(model), 8)
        assert isinstance(step.layers[0][7][2], _QuantCat)
        assert isinstance(step.layers[0][13][2], _QuantCat)


def _prefilled(model: DecoderLM) -> KVCache:
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), cache=cache)
    return cache


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count lean steps taken (rows per call)."""
    calls: list[int] = []
    real = LeanStep.__call__

    def counted(self: LeanStep, ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids.shape[0])
        return real(self, ids)

    monkeypatch.setattr(LeanStep, "__call__", counted)
    return calls


def _greedy(model: DecoderLM, prompt: list[int], n: int, max_seq_len: int = 32) -> list[int]:
    return list(generate_ids(model, prompt, SamplingParams(n, temperature=0.0), max_seq_len))


def test_generation_takes_the_lean_step_and_its_tokens_equal_the_forward_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    # max_seq_len 16 with a 6-token prompt and 30 new tokens: the cache is rebuilt twice
    fast = _greedy(model, [1, 2, 3, 4, 5, 6], 30, max_seq_len=16)
    assert len(calls) >= 25  # every one-token step but the rebuilds' prefills
    monkeypatch.setattr(lean_step, "ENABLED", False)
    n = len(calls)
    assert _greedy(model, [1, 2, 3, 4, 5, 6], 30, max_seq_len=16) == fast
    assert len(calls) == n  # off: the forward only


def test_a_padded_batch_steps_through_the_forward_and_equal_length_rows_take_the_lean_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    params = SamplingParams(6, temperature=0.0)
    same = generate_batch(model, [[1, 2, 3], [4, 5, 6]], params, 32)
    assert calls == [2] * 5  # both rows, every step after the prefill
    calls.clear()
    padded = generate_batch(model, [[1, 2, 3], [7]], params, 32)
    assert calls == []  # a padding column: the forward, which masks it
    monkeypatch.setattr(lean_step, "ENABLED", False)
    assert generate_batch(model, [[1, 2, 3], [4, 5, 6]], params, 32) == same
    assert padded == [_greedy(model, [1, 2, 3], 6), _greedy(model, [7], 6)]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"attention": {"n_heads": 4, "mask": "sliding_window", "window": 4}}, "cache other"),
        ({"position": {"kind": "alibi"}}, "score bias"),
        ({"block": {"parallel": True}}, "pre-norm"),
        ({"attention": {"n_heads": 4, "backend": "math"}}, "sdpa"),
        ({"attention": {"n_heads": 4, "kind": "linear"}}, "cache other"),
    ],
)
def test_kinds_it_does_not_compute_are_refused_with_a_reason_and_generation_is_unchanged(
    extra: dict, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model("default", **extra)
    assert reason in (lean_refusal(model, model.new_cache()) or "")
    calls = _spy(monkeypatch)
    out = _greedy(model, [1, 2, 3], 8)
    assert calls == []
    monkeypatch.setattr(lean_step, "ENABLED", False)
    assert _greedy(model, [1, 2, 3], 8) == out


def test_a_hook_point_in_use_or_added_mid_generation_sends_steps_to_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("llama_gqa")
    seen: list[int] = []

    def record(x: torch.Tensor, name: str) -> None:
        seen.append(x.shape[1])

    with hooks(model, [("layers.0.hook_resid_post", record)]):
        assert "hook point" in (lean_refusal(model, model.new_cache()) or "")
        _greedy(model, [1, 2, 3], 5)
    assert seen == [3, 1, 1, 1, 1]  # the prefill and every decode step ran the hooked forward
    seen.clear()
    calls = _spy(monkeypatch)
    it = generate_ids(model, [1, 2, 3], SamplingParams(6, temperature=0.0), 32)
    first = [next(it), next(it), next(it)]
    assert len(calls) == 2 and seen == []
    with hooks(model, [("layers.0.hook_resid_post", record)]):
        rest = list(it)
    assert len(calls) == 2 and seen == [1, 1, 1]  # hooked from then on: the forward
    monkeypatch.setattr(lean_step, "ENABLED", False)
    assert first + rest == _greedy(model, [1, 2, 3], 6)


def test_weights_changed_between_steps_are_seen_by_the_next_step() -> None:
    model = _model("llama_gqa")
    lean, ref_cache = lean_beside_the_forward(model)
    with torch.no_grad():
        model.layers[1].ffn.down_proj.weight.mul_(3.0)  # in place: bumps its version
        model.layers[0].attn.q_proj.weight = torch.nn.Parameter(
            model.layers[0].attn.q_proj.weight * 0.5
        )  # replaced
        got = lean(torch.tensor([[2]]))
        want = model(torch.tensor([[2]]), cache=ref_cache, last_only=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", ["int8", "int4+a8"])
def test_quantized_buffers_changed_between_steps_are_seen_by_the_next_step(spec: str) -> None:
    """The step reads a quantized layer's buffers once per snapshot: a buffer replaced (a new
    tensor) or changed in place must still reach the next step, fused q/k/v included."""
    model = apply_quantization(_model("mqa_bias", d_model=64), spec)
    lean, ref_cache = lean_beside_the_forward(model)
    with torch.no_grad():
        o = model.layers[0].attn.o_proj
        o.scales = o.scales * 2.0  # replaced
        model.layers[1].attn.q_proj.scales.mul_(0.5)  # in place, inside the fused q/k/v
        model.layers[1].attn.o_proj.bias = model.layers[1].attn.o_proj.bias + 1.0
        got = lean(torch.tensor([[2]]))
        want = model(torch.tensor([[2]]), cache=ref_cache, last_only=True).logits
    assert torch.equal(got, want)


def test_a_model_in_training_mode_is_refused() -> None:
    model = _model("llama_gqa").train()
    assert "training" in (lean_refusal(model, model.new_cache()) or "")


def test_under_autocast_every_step_runs_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama_gqa")
    calls = _spy(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _greedy(model, [1, 2, 3], 5)
        assert calls == []
        monkeypatch.setattr(lean_step, "ENABLED", False)
        assert _greedy(model, [1, 2, 3], 5) == out


@pytest.mark.parametrize(("fused", "linears"), [(True, 2 * 4 + 1), (False, 2 * 7 + 1)])
def test_with_the_fusion_on_q_k_v_and_gate_up_are_one_matmul_each(
    fused: bool, linears: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr("lmlab.nn.fused.ENABLED", fused)
    model = _model("llama_gqa")  # 2 layers: q/k/v, o, gate/up, down each, and the head
    step = LeanStep(model, _prefilled(model), 8)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step(torch.tensor([[3]]))
    names = [e.name for e in p.events()]
    products = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")  # F.linear's or oneDNN's
    assert sum(n in products for n in names) == linears


def test_a_fused_optimizer_step_between_tokens_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW(fused=True) writes the parameters without bumping their version counters: the
    fused q/k/v and gate/up copies must still be rebuilt (lmlab.nn.fused's step hook)."""
    monkeypatch.setattr("lmlab.nn.fused.ENABLED", True)
    model = _model("llama_gqa")
    lean, ref_cache = lean_beside_the_forward(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        got = lean(torch.tensor([[2]]))
        want = model(torch.tensor([[2]]), cache=ref_cache, last_only=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
