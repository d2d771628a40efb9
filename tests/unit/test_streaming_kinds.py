"""Every attention kind that declares ``streams`` runs with the StreamingLLM cache (``mask:
streaming``, lmlab.nn.sinks): the same answer as the ordinary cache before anything is
evicted, exactly the sinks + window after, and flat memory past max_seq_len. Kinds that cannot
stream are refused by their declared reason, and the list of kinds that can comes from the
registry."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.models import build_model
from lmlab.nn.attention import ATTENTION, SoftmaxAttention
from lmlab.nn.sinks import streaming_kinds
from tests.helpers.configs import tiny_model_config

# kind -> its own attention fields (None: the kind's defaults)
NEW_STREAMING: dict[str, dict] = {
    "differential": {"n_kv_heads": 2},
    "sigmoid": {"n_kv_heads": 2},
    "mla": {"kv_lora_rank": 12},
    "mla-absorb": {"kv_lora_rank": 12, "absorb": True},
}
WINDOW, SINKS = 6, 2


def _cfg(kind: str, mask: dict, n_layers: int = 2, max_seq_len: int = 32):
    own = dict(NEW_STREAMING[kind])
    return tiny_model_config(
        attention={"n_heads": 4, "kind": kind.split("-")[0], **own, **mask},
        n_layers=n_layers,
        max_seq_len=max_seq_len,
    )


def _pair(kind: str, window: int, n_layers: int = 2, dtype=torch.float32):
    """(streaming model, causal model) with the same weights (streaming adds no parameter)."""
    torch.manual_seed(0)
    streaming = build_model(
        _cfg(kind, {"mask": "streaming", "window": window, "sink_tokens": SINKS}, n_layers)
    )
    plain = build_model(_cfg(kind, {"mask": "causal"}, n_layers))
    plain.load_state_dict(streaming.state_dict())
    return streaming.to(dtype).eval(), plain.to(dtype).eval()


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) of ``ids`` (B, T): a prefill of ``prefill`` tokens, then one at a time."""
    cache = model.new_cache()
    with torch.no_grad():
        out = [model(ids[:, :prefill], cache=cache).logits]
        out += [model(ids[:, i : i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", NEW_STREAMING)
def test_streaming_equals_the_ordinary_cache_before_any_eviction(kind):
    """12 tokens under window 12: every token sees all earlier ones, so streaming decoding
    equals the causal model's cached decoding (1e-6)."""
    streaming, plain = _pair(kind, window=12)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    got, want = _decode(streaming, ids, 3), _decode(plain, ids, 3)
    assert (got - want).abs().max() < 1e-6


@pytest.mark.parametrize("kind", NEW_STREAMING)
def test_streaming_after_eviction_attends_to_exactly_the_sinks_and_the_window(kind):
    """One float64 layer, 20 tokens, window 6 with 2 sinks: the streamed logits at position p
    equal the causal model run on just tokens 0, 1 and p - 3 .. p at those absolute positions
    (RoPE at absolute positions, lmlab's StreamingLLM convention, nn/sinks.py), to 1e-9."""
    streaming, plain = _pair(kind, WINDOW, n_layers=1, dtype=torch.float64)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(2))
    got = _decode(streaming, ids, 4)
    recent = WINDOW - SINKS
    for p in range(WINDOW, 20):  # past the window: keys SINKS .. p - recent are evicted
        sel = torch.tensor(list(range(SINKS)) + list(range(p - recent + 1, p + 1)))
        with torch.no_grad():
            want = plain(ids[:, sel], position_ids=sel[None]).logits[0, -1]
        assert (got[0, p] - want).abs().max() < 1e-9, p
    # and the reference does depend on what was evicted: the full causal row differs
    with torch.no_grad():
        full = plain(ids).logits[0, -1]
    assert (got[0, -1] - full).abs().max() > 1e-4


@pytest.mark.parametrize("kind", NEW_STREAMING)
def test_generation_past_max_seq_len_keeps_cache_bytes_flat(kind):
    """3 x max_seq_len tokens generated on one cache, never rebuilt; once the window is full
    the cache's bytes stay constant, what the kind declares for window tokens less the new
    one; greedy tokens == argmax of a full pass under the dense streaming mask."""
    cfg = _cfg(kind, {"mask": "streaming", "window": 8, "sink_tokens": SINKS}, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    caches, sizes = [], []
    original = model.new_cache

    def spy():
        caches.append(original())
        return caches[-1]

    model.new_cache = spy  # type: ignore[method-assign]
    prompt = [1, 2, 3]
    out = []
    for tok in generate_ids(model, prompt, SamplingParams(max_new_tokens=48, temperature=0.0), 16):
        out.append(tok)
        sizes.append(caches[-1].nbytes())
    assert len(caches) == 1 and caches[0].seq_len == 3 + 47  # one cache for 51 tokens
    kind_cls = ATTENTION.get(cfg.attention.kind)
    per_layer = kind_cls.kv_cache_bytes(cfg, 1, 8) // 8 * 7  # window - 1 kept between steps
    assert len(set(sizes[10:])) == 1 and sizes[-1] == cfg.n_layers * per_layer
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0]
    assert logits.argmax(-1)[len(prompt) - 1 : -1].tolist() == out


def test_the_streaming_kinds_are_those_declaring_the_trait():
    assert set(streaming_kinds()) >= {"softmax", "sink", "differential", "sigmoid", "mla"}
    assert not {"linear", "moba"} & set(streaming_kinds())


@pytest.mark.parametrize(
    "kind, why",
    [("linear", "constant-size recurrent state"), ("moba", "evicted the blocks")],
)
def test_kinds_that_cannot_stream_are_refused_with_their_reason(kind, why):
    """Validation quotes the kind's declared ``streams_refusal`` and lists the kinds that
    declare ``streams`` (from the registry, in its order)."""
    mask = {"mask": "streaming", "window": 6, "sink_tokens": 2}
    with pytest.raises(ConfigError, match=why) as err:
        tiny_model_config(attention={"n_heads": 4, "kind": kind, **mask})
    message = str(err.value)
    assert message.startswith(
        f"model.attention.mask=streaming cannot run with model.attention.kind={kind}: "
    )
    assert message.endswith(f"; kinds that stream: {', '.join(streaming_kinds())}")


def test_a_plugin_kind_streams_by_declaring_one_attribute():
    """A kind registered with ``streams = True`` is accepted and listed; without it, refused."""

    class Plugin(SoftmaxAttention):
        pass

    class Closed(SoftmaxAttention):
        streams = False

    ATTENTION.register("streams_plugin")(Plugin)
    ATTENTION.register("closed_plugin")(Closed)
    try:
        assert "streams_plugin" in streaming_kinds() and "closed_plugin" not in streaming_kinds()
        mask = {"mask": "streaming", "window": 4, "sink_tokens": 1}
        tiny_model_config(attention={"n_heads": 4, "kind": "streams_plugin", **mask})
        with pytest.raises(ConfigError, match="kinds that stream: .*streams_plugin"):
            tiny_model_config(attention={"n_heads": 4, "kind": "closed_plugin", **mask})
    finally:
        ATTENTION.unregister("streams_plugin")
        ATTENTION.unregister("closed_plugin")


def test_every_kind_that_streams_declares_a_streaming_example():
    """So the generated contract tests (cached == full pass, chunked prefill, left padding,
    declared cache bytes) run it under the streaming cache; softmax runs the mask's own."""
    for name in streaming_kinds():
        examples = ATTENTION.contract(name).examples
        masks = [e.get("attention", {}).get("mask") for e in examples]
        assert name == "softmax" or "streaming" in masks, name


@pytest.mark.parametrize("kind", ["differential", "mla"])
def test_local_global_padding_reaches_kinds_with_their_own_forward(kind):
    """The shared cached-keys step gives every kind the mask's padded form: a left-padded row
    under local_global (2 global tokens) equals the row alone (before the step, differential
    and mla counted padding as positions: 0.3 and 0.1 apart)."""
    from lmlab.nn.masks import position_ids_from_attention_mask

    mask = {"mask": "local_global", "window": 2, "global_tokens": 2}
    cfg = tiny_model_config(attention={"n_heads": 4, "kind": kind, **mask})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    am = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], 1).long()
    with torch.no_grad():
        alone = model(ids).logits[0]
        pos = position_ids_from_attention_mask(am)
        got = model(padded, attention_mask=am, position_ids=pos).logits[0, 3:]
    assert (alone - got).abs().max() < 1e-5


def test_cached_keys_returns_the_kept_keys_with_their_absolute_positions():
    """Window 6, 2 sinks, 20 tokens one at a time: the 20th call attends over positions 0, 1
    and 16..19 (the kept 5 slots and the new key), and its mask lets query 19 see all six."""
    from lmlab.nn.sinks import StreamingMask

    mask = StreamingMask(window=6, sink_tokens=2)
    cache = mask.new_cache()
    keys = [torch.randn(1, 2, 1, 4) for _ in range(20)]
    for p in range(20):
        c = mask.keys(keys[p], keys[p] * 2, torch.tensor([p]), None, cache)
    assert c.positions is not None and c.positions[0].tolist() == [0, 1, 16, 17, 18, 19]
    assert torch.equal(c.k[0, :, 2], keys[16][0, :, 0])  # slot 2 holds position 16's key
    assert c.mask_fn is not None and c.mask_fn(1, 6).all()
