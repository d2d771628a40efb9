"""The logit lens and direct logit attribution of encoder-decoders (lmlab.analysis.lens) on tiny
random T5/BART-style models: every lens row is the decoder stream unembedded by the formula
written out here (final norm, T5's d_model**-0.5, BART's final_logits_bias) and the last is the
model's own output; the attribution sums to the real logit; the cross-attention heads of a
layer add up to what its cross_attn.hook_out writes (so self and cross are not swapped); with
no final norm a last-layer head's term is the logit change of ablating it with the later
sublayer held fixed; post-norm (BART) is refused by name. (``lmlab lens --source`` on a run
folder: tests/e2e/test_lens_cli.py, beside the trained runs it shares.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.analysis.lens import direct_logit_attribution, logit_lens
from lmlab.errors import LmlabError
from lmlab.hooks import run_with_cache, run_with_hooks
from lmlab.models import build_model
from tests.helpers import tiny_model_config
from tests.unit.test_lens import spread

pytestmark = pytest.mark.usefixtures("one_thread")
V = 50
S2S = {"kind": "encoder_decoder"}
CONFIGS = {
    "pre-default": {},
    "t5-style": {
        "norm": {"kind": "rmsnorm"},
        "position": {"kind": "t5_relative"},
        "ffn": {"kind": "geglu"},
        "attention": {"n_heads": 4, "scaled": False},
        "seq2seq": {"scale_decoder_output": True},
    },
    "biases-learned-untied": {
        "norm": {"kind": "layernorm", "bias": True},
        "attention": {"n_heads": 4, "bias": True},
        "position": {"kind": "learned"},
        "tie_embeddings": False,
        "seq2seq": {"final_logits_bias": True},
    },
    "embed-norm": {"position": {"kind": "learned"}, "seq2seq": {"embed_norm": True}},
}
POST = {
    "block": {"kind": "post"},
    "position": {"kind": "learned"},
    "seq2seq": {"final_logits_bias": True},
}  # fmt: skip  (BART)


def s2s(seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny random encoder-decoder with weights larger than the init (logits of order 1)."""
    torch.manual_seed(seed)
    model = spread(build_model(tiny_model_config(vocab_size=V, **S2S, **over)).eval())
    with torch.no_grad():
        if model.final_logits_bias is not None:
            model.final_logits_bias.copy_(torch.randn(1, V))
    return model


@pytest.fixture(scope="module")
def src() -> torch.Tensor:
    return torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(1))


def near(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.shape == want.shape
    err = float((got.detach().double() - want.detach().double()).abs().max())
    assert err <= atol, f"max |difference| {err:.3g} > {atol}"


def norm_by_hand(model, x: torch.Tensor) -> torch.Tensor:
    """The decoder's final norm from its formula, float64 (x (..., D))."""
    norm, cfg, x = model.decoder.final_norm, model.cfg, x.double()
    if not cfg.final_norm:
        return x
    w = norm.weight.double()
    if cfg.norm.kind == "rmsnorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm.eps) * w
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    y = (x - mu) / torch.sqrt(var + cfg.norm.eps) * w
    return y + norm.bias.double() if norm.bias is not None else y


def head_by_hand(model, x: torch.Tensor) -> torch.Tensor:
    """Normed decoder stream (..., D) -> logits (..., V): d_model**-0.5 (T5), the head, BART's
    bias."""
    cfg = model.cfg
    if cfg.seq2seq.scale_decoder_output:
        x = x * cfg.d_model**-0.5
    logits = x @ model.lm_head.weight.double().T
    if cfg.seq2seq.final_logits_bias:
        logits = logits + model.final_logits_bias.double()
    return logits


# ----------------------------------------------------------------------------- logit lens


@pytest.mark.parametrize("name", [*CONFIGS, "post"])
def test_every_row_is_the_decoder_stream_unembedded_by_hand_and_the_last_is_the_output(
    name: str, src, ids
):
    model = s2s(**(POST if name == "post" else CONFIGS[name]))
    lens = logit_lens(model, ids, top_k=3, source_ids=src)
    hooks = ["decoder.layers.0.hook_resid_pre", "decoder.layers.0.hook_resid_post",
             "decoder.layers.1.hook_resid_post"]  # fmt: skip
    assert lens.hooks == hooks and lens.row_labels == ["embed", "layer 0", "layer 1"]
    with torch.no_grad():
        plain = model(input_ids=src, decoder_input_ids=ids).logits  # no hooks
        _, cache = run_with_cache(model, None, hooks, input_ids=src, decoder_input_ids=ids)
    assert torch.equal(lens.logits, plain)
    assert lens.log_probs is not None and lens.log_probs.shape == (1, 3, 7, V)
    assert torch.equal(lens.log_probs[:, -1], F.log_softmax(plain.float(), -1))
    for row, hook in enumerate(hooks):
        want = torch.log_softmax(head_by_hand(model, norm_by_hand(model, cache[hook])), -1)
        near(lens.log_probs[:, row], want, 1e-5)
    assert not torch.allclose(lens.log_probs[:, 0], lens.log_probs[:, -1], atol=1e-3)
    assert model.cfg.seq2seq.scale_decoder_output == (name == "t5-style")  # the rescale ran


def test_a_padded_source_with_its_mask_has_the_lens_of_the_short_source(src, ids):
    model = s2s()
    alone = logit_lens(model, ids, top_k=2, source_ids=src[:, :6])
    padded = torch.cat([src[:, :6], torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    lens = logit_lens(model, ids, top_k=2, source_ids=padded, source_mask=mask)
    assert lens.log_probs is not None and alone.log_probs is not None
    near(lens.log_probs, alone.log_probs, 1e-5)
    unmasked = logit_lens(model, ids, top_k=2, source_ids=padded)  # the mask is used
    assert unmasked.log_probs is not None
    assert not torch.allclose(unmasked.log_probs, alone.log_probs, atol=1e-3)


# ----------------------------------------------------------------------------- attribution


def clean_logits(model, src, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=src, decoder_input_ids=ids).logits[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_attribution_sums_to_the_real_logit_with_self_and_cross_heads(name, src, ids):
    model = s2s(**CONFIGS[name])
    logits = clean_logits(model, src, ids)
    best, worst = logits.argmax(-1).tolist(), logits.argmin(-1).tolist()
    for target, versus, pos in ((best[-1], None, -1), (best[2], worst[2], 2)):
        d = direct_logit_attribution(model, ids, target, versus, pos, source_ids=src)
        want = float(logits[pos, target] - (logits[pos, versus] if versus is not None else 0))
        assert d.actual == pytest.approx(want, abs=1e-5)
        assert abs(d.total - want) < 1e-4, (name, d.total, want)
        assert abs(want) > 0.05
    assert d.heads.shape == (2, 4) and d.cross_heads is not None and d.cross_heads.shape == (2, 4)
    for i in range(2):
        for what in ("self", "cross"):
            assert [n for n in d.names if n.startswith(f"L{i}.{what}.H")] == [
                f"L{i}.{what}.H{h}" for h in range(4)
            ]
    biases = name == "biases-learned-untied"
    assert ("L1.cross.bias" in d.names) == biases and ("L0.self.bias" in d.names) == biases
    assert ("final_logits_bias" in d.names) == biases
    assert ("positions" in d.names) == biases  # learned positions; embed-norm: one embed term
    assert not any(n.startswith("L0H") for n in d.names)  # the decoder-only names are not used


@pytest.mark.parametrize("name", ["t5-style", "biases-learned-untied"])
def test_each_sublayers_terms_add_up_to_what_its_hook_out_writes(name: str, src, ids):
    """Layer i's cross heads (+ cross bias) sum to cross_attn.hook_out pushed through the frozen
    final norm and the scaled unembedding row, computed here from the cache; likewise the self
    heads with attn.hook_out. Swapping self and cross, or a wrong head slice, fails this."""
    model = s2s(**CONFIGS[name])
    target, pos = 11, 4
    d = direct_logit_attribution(model, ids, target, position=pos, source_ids=src)
    names = ["decoder.layers.1.hook_resid_post"] + [
        f"decoder.layers.{i}.{a}.hook_out" for i in range(2) for a in ("attn", "cross_attn")
    ]
    with torch.no_grad():
        _, cache = run_with_cache(model, None, names, input_ids=src, decoder_input_ids=ids)
    resid = cache[names[0]][0, pos].double()
    cfg, w = model.cfg, model.decoder.final_norm.weight.detach().double()
    if cfg.norm.kind == "rmsnorm":
        s = torch.sqrt(resid.pow(2).mean() + cfg.norm.eps)
        frozen = lambda c: c / s * w  # noqa: E731
    else:
        s = torch.sqrt(resid.var(unbiased=False) + cfg.norm.eps)
        frozen = lambda c: (c - c.mean()) / s * w  # noqa: E731
    u = model.lm_head.weight[target].detach().double()
    u = u * (cfg.d_model**-0.5 if cfg.seq2seq.scale_decoder_output else 1.0)
    assert d.scale == pytest.approx(float(s), rel=1e-12)
    for i in range(2):
        for what, hook in (("self", "attn"), ("cross", "cross_attn")):
            out = cache[f"decoder.layers.{i}.{hook}.hook_out"][0, pos]
            want = float(frozen(out.double()) @ u.detach())
            got = sum(v for n, v in zip(d.names, d.values.tolist(), strict=True)
                      if n.startswith(f"L{i}.{what}."))  # fmt: skip
            assert got == pytest.approx(want, abs=1e-5), (i, what)
            assert abs(want) > 1e-3  # a term worth checking
    # the self and cross sums differ, so a swap of the two could not pass
    assert abs(float(d.heads[1].sum()) - float(d.cross_heads[1].sum())) > 1e-3  # type: ignore[index]


def zero_head(h: int):
    def fn(z: torch.Tensor, _: str) -> torch.Tensor:
        z = z.clone()
        z[:, h] = 0.0
        return z

    return fn


def test_without_a_final_norm_a_last_layer_heads_term_is_its_ablation_effect(src, ids):
    """No final norm: the logit is linear in the final residual. Zeroing last-layer head h of
    the cross-attention (hook_z) with the FFN output after it held at its clean value changes
    the logit by exactly that head's term; the same for a self-attention head with the
    cross-attention and FFN outputs held. Includes the output rescale and logit bias."""
    model = s2s(final_norm=False, tie_embeddings=False,
                seq2seq={"scale_decoder_output": True, "final_logits_bias": True})  # fmt: skip
    with torch.no_grad():
        model.decoder.layers[1].cross_attn.o_proj.weight.mul_(10.0)  # heads' terms of order 0.1
        model.lm_head.weight.mul_(10.0)
    target, pos = 5, 3
    kw = {"input_ids": src, "decoder_input_ids": ids}
    later = ["decoder.layers.1.cross_attn.hook_out", "decoder.layers.1.ffn.hook_out"]
    with torch.no_grad():
        out, cache = run_with_cache(model, None, later, **kw)
    clean = float(out.logits[0, pos, target])
    d = direct_logit_attribution(model, ids, target, position=pos, source_ids=src)
    assert d.scale == 1.0 and abs(d.total - clean) < 1e-4
    held = {name: (lambda x, n: cache[n]) for name in later}
    with torch.no_grad():
        for h in range(4):
            for what, hook, keep in (("cross", "cross_attn", later[1:]), ("self", "attn", later)):
                fns = {f"decoder.layers.1.{hook}.hook_z": zero_head(h)}
                fns.update({n: held[n] for n in keep})
                ablated = float(run_with_hooks(model, None, fns, **kw).logits[0, pos, target])
                assert clean - ablated == pytest.approx(d[f"L1.{what}.H{h}"], abs=1e-5)
    assert max(abs(d[f"L1.cross.H{h}"]) for h in range(4)) > 0.05


# ----------------------------------------------------------------------------- refusals


def test_post_norm_and_missing_or_misplaced_sources_are_refused(src, ids):
    post = s2s(**POST)
    with pytest.raises(LmlabError, match="pre-norm decoder blocks") as e:
        direct_logit_attribution(post, ids, 3, source_ids=src)
    assert "model.block.kind=post" in str(e.value) and "not a sum" in str(e.value)
    model = s2s()
    for fn in (lambda: logit_lens(model, ids), lambda: direct_logit_attribution(model, ids, 3)):
        with pytest.raises(LmlabError, match="model.kind=encoder_decoder: give source_ids"):
            fn()
    with pytest.raises(LmlabError, match="source_ids have 2 rows but ids have 1"):
        logit_lens(model, ids, source_ids=src.repeat(2, 1))
    decoder = build_model(tiny_model_config(vocab_size=V)).eval()
    with pytest.raises(LmlabError, match="go with an encoder-decoder; .*model.kind=decoder"):
        logit_lens(decoder, ids, source_ids=src)
    with pytest.raises(LmlabError, match="go with an encoder-decoder"):
        direct_logit_attribution(decoder, ids, 3, source_ids=src)
