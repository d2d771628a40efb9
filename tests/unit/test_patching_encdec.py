"""Activation patching on an encoder-decoder (lmlab.analysis.patching with clean_source /
corrupted_source): patching every activation of a run into itself gives its logits exactly;
the clean encoder output patched into a run with a corrupted source restores the clean logits
bit for bit (the decoder sees the source only through that memory); an encoder patch at an
unchanged source position in layer 0 scores exactly 0 and at the changed one exactly 1; all
cross-attention heads of a layer together equal that layer's cross_attn.hook_out (and one head
equals a float64 computation through o_proj); batched rows equal one-at-a-time rows (each row
runs its own encoder); the maps have the encoder's and the decoder's shapes; refusals name
their cause.

The model runs in float64: these are bit-for-bit claims about rows of a batch, and float32 GEMM
on some CPUs (Intel AMX/oneDNN) rounds a row differently with the batch size (seen with K=128),
which float64 does not."""

from __future__ import annotations

import copy

import pytest
import torch

from lmlab.analysis.patching import (
    ENCODER_DECODER_DEFAULT_WHAT,
    ENCODER_DECODER_POINTS,
    Patch,
    _row_hooks,
    patch_activations,
    run_patched,
)
from lmlab.errors import LmlabError
from lmlab.hooks import run_with_cache, run_with_hooks
from lmlab.models import build_model
from tests.helpers import tiny_model_config

pytestmark = pytest.mark.usefixtures("one_thread")
V, S, T, H = 37, 6, 5, 4  # vocab, source tokens, decoder tokens, heads
T5 = dict(
    position={"kind": "t5_relative", "num_buckets": 8, "max_distance": 16},
    attention={"n_heads": H, "scaled": False},
    norm={"kind": "rmsnorm"},
    ffn={"kind": "gated", "activation": "gelu_tanh", "bias": False},
    seq2seq={"scale_decoder_output": True, "n_decoder_layers": 3},  # 2 encoder, 3 decoder
)
BART = dict(
    block={"kind": "post"},
    position={"kind": "learned", "offset": 2},
    attention={"n_heads": H, "bias": True},
    final_norm=False,
)


def make(style: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tiny_model_config(vocab_size=V, kind="encoder_decoder", **copy.deepcopy(style))
    cfg.seq2seq.pad_token_id, cfg.seq2seq.decoder_start_token_id, cfg.seq2seq.eos_token_id = 0, 1, 2
    return build_model(cfg).double().eval()


@pytest.fixture(scope="module")
def setup():
    model = make(T5)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (1, S), generator=g)
    bad = src.clone()
    bad[0, 2] = 3 + (src[0, 2] - 3 + 11) % (V - 3)  # one source token differs
    start = torch.ones(1, 1, dtype=torch.long)  # the decoder start token (id 1)
    dec = torch.cat([start, torch.randint(3, V, (1, T - 1), generator=g)], 1)
    return model, src, bad, dec


# The float64 model's logits and scores to float64 rounding, not bit for bit: a patched run is
# one row of a batch, and whether a BLAS computes a row with the same bits at every batch size
# depends on the machine (MKL on a Xeon did here; on an AMD EPYC (Zen 5) rows came out 1e-15
# apart: another kernel for another row count).
ROUNDING = 1e-12


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= ROUNDING * (1 + b.abs().max()))


def run(model, src, dec, **kw):
    return model(input_ids=src, decoder_input_ids=dec, **kw).logits


@pytest.mark.parametrize("style", ["t5", "bart"])
def test_patching_every_activation_of_a_run_into_itself_gives_its_logits_exactly(style):
    model = make({"t5": T5, "bart": BART}[style])
    g = torch.Generator().manual_seed(2)
    src, dec = torch.randint(3, V, (1, S), generator=g), torch.randint(3, V, (1, T), generator=g)
    fused = lambda n: not n.endswith(("hook_scores", "hook_pattern"))  # noqa: E731
    with torch.no_grad():
        plain = run(model, src, dec)
        _, cache = run_with_cache(model, None, names=fused, input_ids=src, decoder_input_ids=dec)
        names = [n for n in cache if n != "hook_logits"]
        assert sum(n.startswith("encoder.") for n in names) >= 10
        assert sum(".cross_attn." in n for n in names) >= 8
        got = run_patched(model, dec, cache, [[Patch(n)] for n in names], source_ids=src)
        assert all(_same(got[r : r + 1], plain) for r in range(len(names)))
        every = run_patched(model, dec, cache, [[Patch(n) for n in names]], source_ids=src)
        assert _same(every, plain)


def test_the_clean_encoder_output_restores_the_clean_logits_exactly(setup):
    model, src, bad, dec = setup
    last = "encoder.layers.1.hook_resid_post"
    with torch.no_grad():
        clean, corrupt = run(model, src, dec), run(model, bad, dec)
        _, cache = run_with_cache(model, None, names=[last, "encoder.layers.0.hook_resid_pre"],
                                  input_ids=src, decoder_input_ids=dec)  # fmt: skip
        got = run_patched(model, dec, cache, [[Patch(last)], [Patch(last, s) for s in range(S)]],
                          source_ids=bad)  # fmt: skip
    assert not torch.equal(clean, corrupt)
    assert _same(got[0:1], clean) and _same(got[1:2], clean)


def test_layer_0_source_patches_score_1_at_the_changed_token_and_0_elsewhere(setup):
    model, src, bad, dec = setup
    r = patch_activations(model, dec, dec, 3, 5, what=("encoder.resid_pre", "resid_pre"),
                          clean_source=src, corrupted_source=bad)  # fmt: skip
    e = r.scores["encoder.resid_pre"]
    assert e.shape == (2, S) and e.dtype == torch.float64 and r.n_source == S
    assert abs(e[0, 2] - 1.0) < ROUNDING  # the whole source difference enters there
    assert e[0, [0, 1, 3, 4, 5]].abs().max() < ROUNDING  # identical values: a no-op
    # the decoder input is the same in both runs: layer 0's decoder residual carries nothing
    d = r.scores["resid_pre"]
    assert d.shape == (3, T) and d[0].abs().max() < ROUNDING
    assert d[-1, -1] != 0.0  # later layers carry the source through cross-attention
    assert r.as_dict()["n_source"] == S


def test_all_cross_heads_of_a_layer_are_its_cross_attention_output(setup):
    """hook_z (B, H, T, hd) feeds o_proj: all H heads patched = hook_out patched, bit for bit;
    with T != H a head index on the position axis would not match. One head alone: the
    corrupted output plus o_proj of that head's z difference, in float64."""
    model, src, bad, dec = setup
    z, out = "decoder.layers.1.cross_attn.hook_z", "decoder.layers.1.cross_attn.hook_out"
    with torch.no_grad():
        _, c = run_with_cache(model, None, names=[z, out], input_ids=src, decoder_input_ids=dec)
        heads = run_patched(model, dec, c, [[Patch(z, head=h) for h in range(H)]], source_ids=bad)
        whole = run_patched(model, dec, c, [[Patch(out)]], source_ids=bad)
        assert torch.equal(heads, whole)
        part = run_patched(model, dec, c, [[Patch(z, head=h) for h in range(H - 1)]],
                           source_ids=bad)  # fmt: skip
        assert not torch.equal(part, whole)
        # one head by hand: cross_attn.hook_out = o_proj(z heads concatenated)
        _, x = run_with_cache(model, None, names=[z, out], input_ids=bad, decoder_input_ids=dec)
        h, hd = 2, c[z].shape[-1]
        w = model.decoder.layers[1].cross_attn.o_proj.weight.double()  # (D, H hd)
        dz = (c[z][0, h] - x[z][0, h]).double()  # (T, hd)
        want = x[out][0].double() + dz @ w[:, h * hd : (h + 1) * hd].T
        seen: dict[str, torch.Tensor] = {}
        fns = [*_row_hooks([[Patch(z, head=h)]], c).items(),
               (out, lambda a, n: seen.setdefault(n, a.detach()))]  # fmt: skip
        run_with_hooks(model, None, fns, input_ids=bad, decoder_input_ids=dec)
    assert (want - x[out][0].double()).abs().max() > 1e-3  # the head matters
    assert (seen[out][0].double() - want).abs().max() < 1e-5
    r = patch_activations(model, dec, dec, 3, 5, what=("cross_heads", "cross_out"),
                          clean_source=src, corrupted_source=bad)  # fmt: skip
    assert r.scores["cross_heads"].shape == (3, H) and r.scores["cross_out"].shape == (3, T)


def test_batched_rows_each_run_their_own_encoder(setup):
    """Batched rows of encoder patches equal one-at-a-time runs: no row reads another row's
    memory or cross-attention keys and values."""
    model, src, bad, dec = setup
    what = ("encoder.resid_post", "encoder.heads", "resid_cross", "cross_heads")
    batched = patch_activations(model, dec, dec, 3, None, what, clean_source=src,
                                corrupted_source=bad)  # fmt: skip
    single = patch_activations(model, dec, dec, 3, None, what, batch_size=1, clean_source=src,
                               corrupted_source=bad)  # fmt: skip
    assert [tuple(batched.scores[w].shape) for w in what] == [(2, S), (2, H), (3, T), (3, H)]
    for w in what:
        assert (batched.scores[w] - single.scores[w]).abs().max() < 1e-6, w
    assert batched.scores["encoder.resid_post"][-1].abs().max() > 0.01  # not trivially 0
    top = batched.top(3, "encoder.heads")
    assert len(top) == 3 and all("head" in c for c in top)


def test_the_default_maps_and_a_decoder_only_difference(setup):
    model, src, _, dec = setup
    other = dec.clone()
    other[0, 2] = 3 + (dec[0, 2] - 3 + 5) % (V - 3)  # the decoder input differs, not the source
    r = patch_activations(model, dec, other, 3, 5, clean_source=src, corrupted_source=src)
    assert tuple(r.scores) == ENCODER_DECODER_DEFAULT_WHAT
    assert r.scores["encoder.resid_pre"].abs().max() < ROUNDING  # the sources are the same
    assert abs(r.scores["resid_pre"][0, 2] - 1.0) < ROUNDING
    assert set(ENCODER_DECODER_POINTS) >= {"encoder.heads", "cross_out", "resid_cross"}


def test_refusals_name_their_cause(setup):
    model, src, bad, dec = setup
    kw = {"clean_source": src, "corrupted_source": bad}
    with pytest.raises(LmlabError, match="clean source is 6 tokens and the corrupted one 5"):
        patch_activations(model, dec, dec, 3, 5, clean_source=src, corrupted_source=bad[:, :5])
    with pytest.raises(LmlabError, match="clean prompt is 5 tokens and the corrupted one 4"):
        patch_activations(model, dec, dec[:, :4], 3, 5, **kw)
    with pytest.raises(LmlabError, match="give both"):
        patch_activations(model, dec, dec, 3, 5, clean_source=src)
    with pytest.raises(LmlabError, match=r"unknown patch target.*'encoder\.cross_heads'"):
        patch_activations(model, dec, dec, 3, 5, what=("encoder.cross_heads",), **kw)
    with pytest.raises(LmlabError, match="key_mask"):
        patch_activations(model, dec, dec, 3, 5, key_mask=torch.ones(1, T), **kw)
    decoder = build_model(tiny_model_config(vocab_size=V)).eval()
    with pytest.raises(LmlabError, match="has no encoder"):
        patch_activations(decoder, dec, dec, 3, 5, **kw)
    with pytest.raises(LmlabError, match=r"unknown patch target.*'cross_heads'"):
        patch_activations(decoder, dec, dec, 3, 5, what=("cross_heads",))
