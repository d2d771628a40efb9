"""``need_weights=True`` is built on the hook points: every attention field of a model's output
is, bit for bit, the ``hook_pattern`` that ``run_with_cache`` records in the same pass (the
differential's two maps side by side, the sink's column dropped), for every attention kind, an
encoder, an encoder-decoder's self, cross and encoder maps, a left-padded batch and a cached
step; the logits do not depend on it; nothing is registered when it is False; a user's own
pattern hook sees the very tensor the output returns."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.hooks import hook_points, run_with_cache, run_with_hooks
from lmlab.models import build_model
from lmlab.nn.masks import position_ids_from_attention_mask
from tests.helpers import SEQ2SEQ, encoder_config, tiny_model_config

V = 50
Inputs = Callable[[torch.nn.Module], tuple[torch.Tensor | None, dict]]


def _model(kind: str = "decoder", **fields: object) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "encoder":
        cfg = encoder_config(V)
    elif kind == "seq2seq":
        cfg = tiny_model_config(V, **SEQ2SEQ)
    else:
        attention = {"n_heads": 4, "backend": "math", **fields.pop("attention", {})}  # type: ignore[dict-item]
        cfg = tiny_model_config(V, attention=attention, **fields)
    return build_model(cfg).eval()


def _ids(b: int, t: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _plain(model):
    return _ids(2, 9), {}


def _left_padded(model):
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # row 1: three padding queries that see no key
    pos = position_ids_from_attention_mask(mask)
    return _ids(2, 9), {"attention_mask": mask, "position_ids": pos}


def _cached_step(model):
    """A fresh cache holding a prefill of 8 tokens; the step is token 9."""
    ids, cache = _ids(2, 9), model.new_cache()
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
    return ids[:, 8:], {"cache": cache}


def _encoder(model):
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    return _ids(2, 9), {"attention_mask": mask}


def _seq2seq(model):
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    return _ids(2, 8), {"attention_mask": mask, "decoder_input_ids": _ids(2, 6, seed=3)}


def _seq2seq_step(model):
    src, kw = _seq2seq(model)
    dec, cache = kw.pop("decoder_input_ids"), model.new_cache()
    with torch.no_grad():
        model(src, decoder_input_ids=dec[:, :5], cache=cache, **kw)
    return None, {"decoder_input_ids": dec[:, 5:], "cache": cache}


# name -> (model, inputs, whether need_weights=False runs the same formula: math backend and no
# sparse/gathered path, so its logits are bit for bit those of need_weights=True)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], Inputs, bool]] = {
    "softmax_sdpa": (lambda: _model(attention={"backend": "sdpa"}), _plain, False),
    "softmax": (lambda: _model(), _plain, True),
    "gqa": (lambda: _model(attention={"n_kv_heads": 2}), _plain, True),
    "mqa": (lambda: _model(attention={"n_kv_heads": 1}), _plain, True),
    "linear": (lambda: _model(attention={"kind": "linear"}), _plain, True),
    "mla": (lambda: _model(attention={"kind": "mla"}), _plain, True),
    "mla_absorb": (lambda: _model(attention={"kind": "mla", "absorb": True}), _plain, True),
    "differential": (lambda: _model(attention={"kind": "differential"}), _plain, True),
    "sink": (lambda: _model(attention={"kind": "sink"}), _plain, True),
    "sigmoid": (lambda: _model(attention={"kind": "sigmoid"}), _plain, True),
    "local_global": (
        lambda: _model(attention={"mask": "local_global", "window": 1, "global_tokens": 1}),
        _plain,
        False,  # unhooked, its sparse path runs
    ),
    "moba": (lambda: _model(attention={"kind": "moba", "moba_block_size": 3}), _plain, False),
    "hyper_block": (lambda: _model(block={"kind": "hyper"}), _plain, True),
    "padded_softmax": (lambda: _model(), _left_padded, True),
    "padded_sink": (lambda: _model(attention={"kind": "sink"}), _left_padded, True),
    "padded_differential": (lambda: _model(attention={"kind": "differential"}), _left_padded, True),
    "cached_softmax": (lambda: _model(), _cached_step, True),
    "cached_mla_absorb": (
        lambda: _model(attention={"kind": "mla", "absorb": True}),
        _cached_step,
        True,
    ),
    "encoder": (lambda: _model("encoder"), _encoder, False),
    "seq2seq": (lambda: _model("seq2seq"), _seq2seq, False),
    "seq2seq_cached": (lambda: _model("seq2seq"), _seq2seq_step, False),
}


def _forward(model, ids, kw, **extra):
    with torch.no_grad():
        return model(**kw, **extra) if ids is None else model(ids, **kw, **extra)


def _expected_maps(model, cache) -> dict[str, list[torch.Tensor]]:
    """The output's attention fields spelled out from the recorded hook points."""

    def pattern(prefix: str, attn_kind: str) -> torch.Tensor:
        p = cache[f"{prefix}.hook_pattern"]
        if attn_kind == "differential":  # heads [0, H/2) the first maps, [H/2, H) the second
            return torch.cat([p, cache[f"{prefix}.hook_pattern_2"]], dim=1)
        return p[..., :-1] if attn_kind == "sink" else p  # the sink's column is the last

    kind = model.cfg.attention.kind
    if hasattr(model, "decoder"):
        enc, dec = len(model.encoder.layers), len(model.decoder.layers)
        fields = {
            "attentions": [pattern(f"decoder.layers.{i}.attn", kind) for i in range(dec)],
            "cross_attentions": [
                pattern(f"decoder.layers.{i}.cross_attn", "softmax") for i in range(dec)
            ],
            "encoder_attentions": [
                pattern(f"encoder.layers.{i}.attn", kind)
                for i in range(enc)
                if f"encoder.layers.{i}.attn.hook_pattern" in cache  # the encoder ran
            ],
        }
        return fields
    return {"attentions": [pattern(f"layers.{i}.attn", kind) for i in range(len(model.layers))]}


@pytest.mark.parametrize("name", list(CASES))
def test_need_weights_fields_are_the_recorded_patterns_bit_for_bit(name):
    build, inputs, same_formula = CASES[name]
    model = build()
    ids, kw = inputs(model)
    out = _forward(model, ids, kw, need_weights=True)
    ids, kw = inputs(model)  # a fresh cache, if any
    with torch.no_grad():
        hooked, cache = run_with_cache(model, ids, lambda n: "hook_pattern" in n, **kw)
    expected = _expected_maps(model, cache)
    assert expected["attentions"], "no map recorded: the test would prove nothing"
    for field, maps in expected.items():
        got = getattr(out, field)
        assert len(got) == len(maps), field
        for i, (g, want) in enumerate(zip(got, maps, strict=True)):
            assert g.dtype == want.dtype and g.shape == want.shape, (field, i)
            assert torch.equal(g, want), (field, i)
    assert torch.equal(out.logits, hooked.logits)
    ids, kw = inputs(model)
    plain = _forward(model, ids, kw)
    assert plain.attentions == [] and getattr(plain, "cross_attentions", []) == []
    if same_formula:
        assert torch.equal(plain.logits, out.logits)
    else:  # sdpa, a sparse or gathered path: the same function to float rounding
        torch.testing.assert_close(plain.logits, out.logits, atol=1e-5, rtol=1e-5)


def _registered(model) -> int:
    return sum(len(p.fns) for n, p in hook_points(model).items() if ".attn" in n)


@pytest.mark.parametrize("need_weights", [False, True])
def test_nothing_is_registered_without_need_weights_and_everything_is_removed(need_weights):
    model = _model(attention={"kind": "differential"})
    during: list[int] = []

    def count(x, _):
        during.append(_registered(model))

    run_with_hooks(model, _ids(2, 7), {"layers.1.hook_resid_pre": count}, need_weights=need_weights)
    # during the pass: no recorder without need_weights; with it, both maps' points of 2 layers
    assert during == [4 if need_weights else 0]
    assert _registered(model) == 0

    def fail(x, _):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, _ids(2, 7), {"layers.0.hook_resid_mid": fail}, need_weights=True)
    assert _registered(model) == 0  # removed on error too


def test_a_users_pattern_hook_and_need_weights_see_the_same_tensor():
    model = _model()
    seen: list[torch.Tensor] = []
    name = "layers.1.attn.hook_pattern"
    with torch.no_grad():
        out = run_with_hooks(
            model, _ids(2, 7), {name: lambda x, _: seen.append(x)}, need_weights=True
        )
    assert len(seen) == 1 and out.attentions[1] is seen[0]
    # a hook that replaces the pattern replaces the map too (the recorder runs after it)
    with torch.no_grad():
        edited = run_with_hooks(
            model, _ids(2, 7), {name: lambda x, _: torch.zeros_like(x)}, need_weights=True
        )
    assert torch.equal(edited.attentions[1], torch.zeros_like(seen[0]))
    assert torch.equal(edited.attentions[0], out.attentions[0])
    assert not torch.allclose(edited.logits, out.logits)


def test_kinds_without_a_map_refuse_before_running():
    nsa = _model(attention={"kind": "nsa"})
    with pytest.raises(LmlabError, match="nsa has no single attention map"):
        _forward(nsa, _ids(1, 6), {}, need_weights=True)
    linear = _model(attention={"kind": "linear"})
    cache = linear.new_cache()
    _forward(linear, _ids(1, 4), {"cache": cache}, need_weights=True)  # empty cache: fine
    with pytest.raises(LmlabError, match="cannot return weights over cached tokens"):
        _forward(linear, _ids(1, 1), {"cache": cache}, need_weights=True)
    assert cache.seq_len == 4  # refused before any layer ran: the cache is untouched
    assert _registered(nsa) == _registered(linear) == 0
