"""The attention core and the backend / activation registries: a user-registered backend or
activation is what the model runs, a backend's declared traits decide how the core calls it."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import ConfigError
from lmlab.models import build_model
from lmlab.nn.attention_core import (
    ATTENTION_BACKENDS,
    attend,
    attention_math,
    attention_sdpa,
    backend_traits,
)
from lmlab.nn.ffn import ACTIVATIONS, MLP
from lmlab.nn.masks import causal_mask, sliding_window_mask
from tests.helpers import tiny_model_config

V = 41


@pytest.fixture
def recording():
    """A backend ``recording`` with no traits: it sees every call's mask and runs sdpa on it."""
    calls: list[torch.Tensor | None] = []

    def backend(q, k, v, mask, scale, dropout_p=0.0):
        calls.append(mask)
        return attention_sdpa(q, k, v, mask, scale, dropout_p)

    ATTENTION_BACKENDS.register("recording", "test backend")(backend)
    yield calls
    ATTENTION_BACKENDS.unregister("recording")


def _pair(backend: str, **model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights with ``backend`` and with the math backend."""
    attention = {"n_heads": 4, **model.pop("attention", {})}
    torch.manual_seed(0)
    a = build_model(tiny_model_config(V, attention={**attention, "backend": backend}, **model))
    torch.manual_seed(0)
    b = build_model(tiny_model_config(V, attention={**attention, "backend": "math"}, **model))
    return a.eval(), b.eval()


def test_a_registered_backend_is_the_one_the_model_calls_with_a_bool_causal_mask(recording):
    mine, ref = _pair("recording")
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(mine(x).logits, ref(x).logits, atol=1e-5, rtol=1e-5)
    assert len(recording) == mine.cfg.n_layers  # one call per layer, none to another backend
    # without causal_fast_path it is never asked to be causal itself: it gets the mask
    mask = recording[0]
    assert mask is not None and mask.dtype == torch.bool
    assert torch.equal(mask, causal_mask(9, 9))


def test_a_backend_without_takes_bias_gets_the_score_bias_folded_into_a_float_mask(recording):
    mine, ref = _pair("recording", position={"kind": "alibi"})
    x = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(mine(x).logits, ref(x).logits, atol=1e-5, rtol=1e-5)
    mask = recording[0]
    assert mask is not None and mask.is_floating_point()
    assert torch.isinf(mask[..., 0, 1:]).all() and torch.isfinite(mask[..., -1, :]).all()


def test_need_weights_with_a_backend_that_returns_none_uses_math(recording):
    mine, _ = _pair("recording")
    with torch.no_grad():
        out = mine(torch.randint(0, V, (1, 5)), need_weights=True)
    assert recording == []  # math, not the recording backend, ran
    w = out.attentions[0]
    assert w is not None and w.shape == (1, 4, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 5))


def test_a_backend_declaring_takes_bias_and_returns_weights_receives_both():
    seen: dict[str, object] = {}

    def backend(q, k, v, mask, scale, dropout_p=0.0, bias=None):
        seen["bias"] = bias
        return attention_math(q, k, v, mask, scale, dropout_p, bias)

    ATTENTION_BACKENDS.register("biased", "test backend")(
        backend_traits(backend, returns_weights=True, takes_bias=True)
    )
    try:
        q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        bias = torch.randn(2, 4, 4)
        kw = dict(scale=0.3, mask_fn=causal_mask, bias=bias)
        y, w = attend(q, k, v, backend=ATTENTION_BACKENDS["biased"], **kw)
        assert seen["bias"] is bias and w is not None
        y_math, w_math = attend(q, k, v, backend=attention_math, **kw)
        assert torch.equal(y, y_math) and w_math is not None and torch.equal(w, w_math)
    finally:
        ATTENTION_BACKENDS.unregister("biased")


def test_attend_zeroes_queries_that_see_no_key_and_shares_kv_heads():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    key_mask = torch.ones(2, 5, dtype=torch.bool)
    key_mask[0, :3] = False  # row 0: queries 0..2 see no key through a window of 2
    for backend in (attention_sdpa, attention_math):
        y, w = attend(
            q, k, v, backend=backend, scale=0.3, n_rep=2, mask_fn=sliding_window_mask,
            window=2, key_mask=key_mask,
        )  # fmt: skip
        assert torch.equal(y[0, :, :3], torch.zeros(4, 3, 8))
        assert y[0, :, 3:].abs().sum() > 0 and y[1].abs().sum(-1).min() > 0
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        mask = sliding_window_mask(5, 5, window=2) & key_mask[1]
        expected, _ = attention_math(q[1:], kk[1:], vv[1:], mask, 0.3)
        torch.testing.assert_close(y[1:], expected, atol=1e-5, rtol=1e-5)
        if w is not None:
            assert torch.equal(w[0, :, :3], torch.zeros(4, 3, 5))


def test_an_unknown_backend_is_refused_by_name():
    cfg = tiny_model_config(V)
    cfg.attention.backend = "flash9"
    with pytest.raises(ConfigError, match="model.attention.backend: unknown attention_backend"):
        build_model(cfg)


def test_a_registered_activation_is_the_one_the_ffn_applies():
    ACTIVATIONS.register("square", "x^2 (test)")(torch.square)
    try:
        cfg = tiny_model_config(V, ffn={"kind": "mlp", "activation": "square"})
        mlp = MLP(cfg)
        x = torch.randn(2, 3, cfg.d_model)
        assert torch.equal(mlp(x), mlp.down_proj(mlp.up_proj(x) ** 2))
    finally:
        ACTIVATIONS.unregister("square")
