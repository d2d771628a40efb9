"""The lean decode step (lmlab.generation.lean_step, its one-call C++ step included) under state
changes a caller can make between two tokens of a streamed generation (``generate_ids`` is a
generator): the tokens must be the ones the model's forward gives, as they are with the lean step
off (``lean_step.ENABLED = False``: every step is ``model(...)``).

Each test decodes the same prompt twice with the same change made after the same token, once
with the lean step and once without, and compares the tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lmlab.generation import lean_step
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.models.decoder import DecoderLM
from lmlab.nn.quant import apply_quantization
from tests.helpers import tiny_model_config
from tests.helpers.lean import LLAMA, unit_gain_


def _model(**extra: object) -> DecoderLM:
    torch.manual_seed(0)
    cfg = tiny_model_config(vocab_size=40, **{**LLAMA, **extra})
    return unit_gain_(DecoderLM(cfg).eval())  # type: ignore[return-value]


def _tokens(change: Callable[[DecoderLM], object], lean: bool, temperature: float, **extra: object):
    """Ten tokens of [3, 1, 4, 1, 5] with ``change(model)`` made after the third one."""
    model = _model(**extra)
    params = SamplingParams(10, temperature=temperature, seed=1)
    old = lean_step.ENABLED
    lean_step.ENABLED = lean
    torch.manual_seed(123)  # dropout (train mode) draws from the global generator
    out = []
    try:
        for i, tok in enumerate(generate_ids(model, [3, 1, 4, 1, 5], params, 32)):
            out.append(tok)
            if i == 2:
                change(model)
    finally:
        lean_step.ENABLED = old
    return out


def _swap_down_proj(model: DecoderLM) -> None:
    old = model.layers[0].ffn.down_proj
    new = nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.normal_(0.0, 3.0)
    model.layers[0].ffn.down_proj = new


@pytest.mark.parametrize(
    ("change", "temperature"),
    [
        (_swap_down_proj, 0.0),  # a module replaced (its parameters are new objects)
        (lambda m: apply_quantization(m, "int4:16"), 1.0),  # every linear replaced
    ],
    ids=["replace_linear", "quantize"],
)
def test_a_module_replaced_mid_generation_is_used_by_the_next_step(
    change: Callable[[DecoderLM], object], temperature: float
) -> None:
    # LeanStep.stale compares every child module's slot too (a replaced module's own old
    # parameters are unchanged); without that it kept decoding with the old weights.
    assert _tokens(change, True, temperature) == _tokens(change, False, temperature)


def test_switching_to_train_mode_mid_generation_runs_the_forward() -> None:
    # lean_refusal refuses a model in training mode (dropout), but generate asks it once per
    # cache; LeanStep.declines checks model.training on every step.
    change = nn.Module.train
    assert _tokens(change, True, 0.0, dropout=0.5) == _tokens(change, False, 0.0, dropout=0.5)


# ---- NaN / inf through the one-call C++ step (lmlab.nn.decode_kernel) ----


@pytest.mark.parametrize("act", ["relu", "relu2"])
def test_a_nan_hidden_unit_of_a_relu_mlp_gives_nan_logits_like_the_forward(act: str) -> None:
    # One hidden pre-activation is 0 * inf = NaN at every token (ffn_norm weight and bias 0 in
    # column 0, up_proj inf there); one layer, so the prefill's cache stays finite. torch's relu
    # keeps NaN, so the forward's logits are NaN; the C++ step's activate() once mapped NaN to
    # 0 (`v > 0.0f ? v : 0.0f`) and returned finite logits.
    from lmlab.generation.lean_step import LeanStep
    from lmlab.nn import decode_kernel

    model = _model(n_layers=1, ffn={"kind": "mlp", "activation": act})
    norm = model.layers[0].ffn_norm
    with torch.no_grad():
        norm.weight[0] = 0.0
        if getattr(norm, "bias", None) is not None:
            norm.bias[0] = 0.0
        model.layers[0].ffn.up_proj.weight[3, 0] = float("inf")
        prompt, ids = torch.tensor([[3, 1, 4]]), torch.tensor([[5]])
        ref_cache, cache = model.new_cache(), model.new_cache()
        model(prompt, cache=ref_cache)
        model(prompt, cache=cache)
        ref = model(ids, cache=ref_cache, last_only=True).logits
        lean = LeanStep(model, cache, 8)
        got = lean(ids)
    if decode_kernel.available():
        assert lean.cpp_refusal is None  # the C++ step ran
    assert torch.isnan(ref).all()
    assert torch.isnan(got).all(), got


def test_the_steps_silu_of_minus_inf_is_nan_like_torch() -> None:
    # torch: silu(-inf) = -inf / (1 + inf) = NaN (the step's scalar tail agrees); the vector
    # lanes clamp -x to 87 before exp (-inf / (1 + e^87) = -inf) and so set -inf's to NaN.
    from lmlab.nn import decode_kernel

    if not decode_kernel.available():
        pytest.skip(decode_kernel.status())
    g = torch.full((16,), -float("inf"))
    assert torch.isnan(torch.nn.functional.silu(g)).all()
    got = decode_kernel.silu_mul(g)
    assert torch.isnan(got).all(), got


def test_a_dtype_change_mid_generation_does_not_crash_the_lean_step() -> None:
    # model.double() between two tokens: the forward path decodes on (tokens below). Module.
    # _apply swaps .data (no parameter replaced, no version bump), so LeanStep.stale compares
    # storages too, and lean_refusal refuses a cache of another dtype than the model's; before,
    # the Python loop fed float64 queries and the float32 cache to SDPA and raised.
    change = nn.Module.double
    assert _tokens(change, True, 0.0) == _tokens(change, False, 0.0)
