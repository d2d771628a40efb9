"""Hook points (lmlab.hooks): activations equal Hugging Face's hidden states and attention maps,
patching a run into itself is exact, an ablated head equals the manual computation, hooks are
always removed, and unknown names fail with close names."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.hooks import hook_names, hook_points, run_with_cache, run_with_hooks
from lmlab.models import build_model
from tests.helpers import tiny_model_config

transformers = pytest.importorskip("transformers")

from lmlab.interop.hf import (  # noqa: E402
    gpt2_model_config,
    gpt2_state_dict,
    llama_model_config,
    llama_state_dict,
)
from tests.helpers import hf_config, perturb_all, perturb_vectors  # noqa: E402


def _llama():
    cfg = hf_config("llama", attn_implementation="eager")
    torch.manual_seed(0)
    hf = perturb_vectors(transformers.LlamaForCausalLM(cfg)).eval()
    ours = build_model(llama_model_config(cfg)).eval()
    ours.load_state_dict(llama_state_dict(hf.state_dict(), False), strict=True)
    return hf, ours, 97


def _gpt2():
    cfg = hf_config("gpt2", attn_implementation="eager")
    torch.manual_seed(0)
    hf = perturb_all(transformers.GPT2LMHeadModel(cfg), 0.05).eval()
    ours = build_model(gpt2_model_config(cfg)).eval()
    ours.load_state_dict(gpt2_state_dict(hf.state_dict(), 48), strict=True)
    return hf, ours, 101


@pytest.mark.parametrize("family", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hook_activations_equal_hf_hidden_states_and_attentions(family):
    hf, ours, vocab = family()
    x = torch.randint(0, vocab, (2, 11))
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True, output_attentions=True)
        out, cache = run_with_cache(ours, x)
    n = ours.cfg.n_layers
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["layers.0.hook_resid_pre"], ref.hidden_states[0], **tol)
    for i in range(n - 1):  # HF's last hidden state is after the final norm
        got = cache[f"layers.{i}.hook_resid_post"]
        torch.testing.assert_close(got, ref.hidden_states[i + 1], **tol)
        assert torch.equal(got, cache[f"layers.{i + 1}.hook_resid_pre"])
    torch.testing.assert_close(cache["hook_final_norm"], ref.hidden_states[n], **tol)
    for i in range(n):
        torch.testing.assert_close(cache[f"layers.{i}.attn.hook_pattern"], ref.attentions[i], **tol)
    torch.testing.assert_close(cache["hook_logits"], ref.logits, **tol)
    assert torch.equal(out.logits, cache["hook_logits"])
    # the pattern hook and need_weights agree exactly (both the math formula)
    with torch.no_grad():
        weights = ours(x, need_weights=True).attentions
    for i in range(n):
        assert torch.equal(weights[i], cache[f"layers.{i}.attn.hook_pattern"])


CONFIGS = {
    "default": {},
    "gqa": {"attention": {"n_heads": 4, "n_kv_heads": 2}},
    "mla": {"attention": {"n_heads": 4, "kind": "mla"}},
    "moe": {"ffn": {"kind": "moe"}},
    "differential": {"attention": {"n_heads": 4, "kind": "differential"}},
    "sink": {"attention": {"n_heads": 4, "kind": "sink"}},
    "sigmoid": {"attention": {"n_heads": 4, "kind": "sigmoid"}},
    "linear": {"attention": {"n_heads": 4, "kind": "linear"}},
    "nsa": {"attention": {"n_heads": 4, "kind": "nsa"}},
    "post": {"block": {"kind": "post"}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_patching_every_activation_into_its_own_run_is_exact(name):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(**CONFIGS[name])).eval()
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        clean = model(x).logits
        out, cache = run_with_cache(model, x)
        assert len(cache) > 10 * model.cfg.n_layers // 2  # every layer contributes many points
        patched = run_with_hooks(model, x, {n: (lambda t, n, c=cache: c[n]) for n in cache})
    assert torch.allclose(out.logits, clean, atol=1e-6)  # the math path when hooked
    assert torch.equal(patched.logits, out.logits)
    assert all(not p.fns for p in hook_points(model).values())


def test_patching_the_residual_stream_only_gives_the_clean_logits_exactly():
    torch.manual_seed(0)
    model = build_model(tiny_model_config()).eval()
    x = torch.randint(0, 50, (2, 12))
    names = [n for n in hook_names(model) if "resid" in n or n == "hook_embed"]
    with torch.no_grad():
        clean = model(x).logits
        _, cache = run_with_cache(model, x, names=names)
        patched = run_with_hooks(model, x, {n: (lambda t, n: cache[n]) for n in names})
    assert torch.equal(patched.logits, clean)  # no pattern hook: the sdpa path both times


def test_zero_ablating_one_heads_z_equals_o_proj_of_the_zeroed_heads():
    torch.manual_seed(0)
    model = build_model(tiny_model_config()).eval()
    x = torch.randint(0, 50, (2, 12))
    attn = model.layers[1].attn
    with torch.no_grad():
        _, cache = run_with_cache(model, x, names=["layers.1.attn.hook_z"])
        z = cache["layers.1.attn.hook_z"].clone()  # (B, H, T, hd)
        clean = model(x).logits

        def ablate(t, name):
            t = t.clone()
            t[:, 2] = 0.0
            return t

        got_out = {}
        out = run_with_hooks(
            model,
            x,
            [
                ("layers.1.attn.hook_z", ablate),
                ("layers.1.attn.hook_out", lambda t, n: got_out.setdefault("o", t)),
            ],
        )
        z[:, 2] = 0.0
        b, h, t, hd = z.shape
        manual = attn.o_proj(z.transpose(1, 2).reshape(b, t, h * hd))
    assert torch.equal(got_out["o"], manual)
    assert not torch.allclose(out.logits, clean)


def test_a_hook_that_raises_leaves_no_hook_registered():
    model = build_model(tiny_model_config()).eval()
    x = torch.randint(0, 50, (1, 5))

    def boom(t, name):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, x, {"layers.0.hook_resid_mid": boom, "hook_logits": boom})
    assert all(not p.fns for p in hook_points(model).values())


def test_unknown_hook_name_lists_close_names_and_registers_nothing():
    model = build_model(tiny_model_config()).eval()
    x = torch.randint(0, 50, (1, 5))
    with pytest.raises(LmlabError, match="did you mean layers.0.attn.hook_pattern"):
        run_with_hooks(model, x, {"hook_logits": print, "layers.0.attn.hook_patern": print})
    assert all(not p.fns for p in hook_points(model).values())
    _, cache = run_with_cache(model, x, names=["hook_logits"])
    with pytest.raises(LmlabError, match="did you mean hook_logits"):
        cache["hook_logit"]


def test_a_point_a_kind_does_not_compute_is_refused():
    model = build_model(tiny_model_config(attention={"n_heads": 4, "kind": "nsa"})).eval()
    assert "layers.0.attn.hook_pattern" not in hook_names(model)
    model = build_model(tiny_model_config(block={"parallel": True})).eval()
    assert "layers.0.hook_resid_mid" not in hook_names(model)
    mla = {"n_heads": 4, "kind": "mla", "absorb": True}  # attention over the latent: no q/k/v
    model = build_model(tiny_model_config(attention=mla)).eval()
    x = torch.randint(0, 50, (1, 6))
    with pytest.raises(LmlabError, match="did not run"):
        run_with_hooks(model, x, {"layers.0.attn.hook_q": print})
    with pytest.raises(LmlabError, match="shape"):
        run_with_hooks(model, x, {"hook_embed": lambda t, n: t[:, :1]})


def test_moe_router_hooks_see_the_routing():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(ffn={"kind": "moe"})).eval()
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        out, cache = run_with_cache(model, x, names=lambda n: "layers.0.ffn.hook_" in n)
    logits = cache["layers.0.ffn.hook_router_logits"]
    assert logits.shape == (14, model.cfg.ffn.n_experts) and logits.dtype == torch.float32
    choices = cache["layers.0.ffn.hook_choices"]
    assert torch.equal(choices, logits.topk(model.cfg.ffn.top_k, dim=-1).indices)
    counts = torch.bincount(choices.reshape(-1), minlength=model.cfg.ffn.n_experts)
    assert torch.equal(counts, out.expert_counts[0])


def test_state_dict_keys_have_no_hook_entries():
    for over in CONFIGS.values():
        model = build_model(tiny_model_config(**over))
        assert not any("hook" in k for k in model.state_dict())
        assert len(hook_names(model)) > 0


def test_bert_hooks_equal_hf_hidden_states_and_attentions():
    from lmlab.interop.hf_bert import bert_model_config, bert_state_dict, fit_bert_config

    torch.manual_seed(0)
    hf = perturb_vectors(transformers.BertModel(hf_config("bert", attn_implementation="eager")))
    hf.eval()
    sd = hf.state_dict()
    cfg = fit_bert_config(bert_model_config(hf.config), sd)
    ours = build_model(cfg).eval()
    ours.load_state_dict(bert_state_dict(sd, cfg), strict=True)
    x = torch.randint(0, 61, (2, 9))
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        _, cache = run_with_cache(ours, x, attention_mask=mask)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["layers.0.hook_resid_pre"], ref.hidden_states[0], **tol)
    for i in range(cfg.n_layers):
        got = cache[f"layers.{i}.hook_resid_post"]
        torch.testing.assert_close(got, ref.hidden_states[i + 1], **tol)
        torch.testing.assert_close(cache[f"layers.{i}.attn.hook_pattern"], ref.attentions[i], **tol)


def test_bart_hooks_equal_hf_decoder_states_and_cross_attentions():
    from lmlab.interop.hf_bart import bart_model_config, bart_state_dict

    hf_cfg = hf_config("bart", attn_implementation="eager")
    torch.manual_seed(0)
    hf = perturb_all(transformers.BartForConditionalGeneration(hf_cfg), 0.05).eval()
    cfg = bart_model_config(hf_cfg)
    ours = build_model(cfg).eval()
    ours.load_state_dict(bart_state_dict(hf.state_dict(), cfg), strict=True)
    src, dec = torch.randint(3, 61, (2, 8)), torch.randint(3, 61, (2, 5))
    with torch.no_grad():
        ref = hf(
            input_ids=src,
            decoder_input_ids=dec,
            output_hidden_states=True,
            output_attentions=True,
        )
        out, cache = run_with_cache(ours, src, decoder_input_ids=dec)
    tol = dict(atol=1e-5, rtol=1e-5)
    n_dec = len(ref.decoder_attentions)
    for i in range(n_dec):
        got = cache[f"decoder.layers.{i}.hook_resid_post"]
        torch.testing.assert_close(got, ref.decoder_hidden_states[i + 1], **tol)
        pattern = cache[f"decoder.layers.{i}.cross_attn.hook_pattern"]
        torch.testing.assert_close(pattern, ref.cross_attentions[i], **tol)
        pattern = cache[f"decoder.layers.{i}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, ref.decoder_attentions[i], **tol)
    for i in range(len(ref.encoder_attentions)):
        got = cache[f"encoder.layers.{i}.hook_resid_post"]
        torch.testing.assert_close(got, ref.encoder_hidden_states[i + 1], **tol)
    torch.testing.assert_close(cache["hook_logits"], ref.logits, **tol)
    names = hook_names(ours)
    assert "decoder.layers.0.hook_resid_cross" in names and "encoder.hook_embed" in names


def test_a_deep_copy_has_its_own_hook_points():
    import copy

    model = build_model(tiny_model_config()).eval()
    twin = copy.deepcopy(model)
    x = torch.randint(0, 50, (1, 5))
    seen: list[str] = []
    run_with_hooks(twin, x, {"layers.1.attn.hook_q": lambda t, n: seen.append(n)})
    assert seen == ["layers.1.attn.hook_q"]
    assert twin.layers[1].attn.hook_q is twin.layers[1].attn._modules["hook_q"]
    assert model.layers[1].attn.hook_q is not twin.layers[1].attn.hook_q


@pytest.mark.parametrize("kind", ["sink", "differential", "sigmoid"])
def test_pattern_hooks_hold_what_need_weights_returns(kind):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(attention={"n_heads": 4, "kind": kind})).eval()
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        weights = model(x, need_weights=True).attentions[0]  # (B, H, T, S)
        _, cache = run_with_cache(model, x, names=lambda n: n.startswith("layers.0.attn.hook_pat"))
    pattern = cache["layers.0.attn.hook_pattern"]
    if kind == "sink":  # the sink's column last; need_weights drops it
        assert pattern.shape[-1] == 8 and torch.equal(pattern[..., :7], weights)
    elif kind == "differential":  # the first maps, then hook_pattern_2 the second
        both = torch.cat([pattern, cache["layers.0.attn.hook_pattern_2"]], dim=1)
        assert torch.equal(both, weights)
    else:
        assert torch.equal(pattern, weights)


def test_a_replaced_pattern_drives_the_output_and_cached_decoding_is_hooked():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(attention={"n_heads": 4, "n_kv_heads": 2})).eval()
    x = torch.randint(0, 50, (2, 6))

    def first_key_only(w, name):  # every query attends to token 0 alone
        one_hot = torch.zeros_like(w)
        one_hot[..., 0] = 1.0
        return one_hot

    with torch.no_grad():
        seen = {}
        run_with_hooks(
            model,
            x,
            [
                ("layers.0.attn.hook_pattern", first_key_only),
                ("layers.0.attn.hook_v", lambda t, n: seen.setdefault("v", t)),
                ("layers.0.attn.hook_z", lambda t, n: seen.setdefault("z", t)),
            ],
        )
        v0 = seen["v"][:, :, :1].repeat_interleave(2, dim=1)  # (B, H, 1, hd): GQA pairs
        assert torch.equal(seen["z"], v0.expand_as(seen["z"]))
        cache = model.new_cache()
        model(x[:, :5], cache=cache)
        name = "layers.1.attn.hook_pattern"
        out, got = run_with_cache(model, x[:, 5:], names=[name], cache=cache)
        assert got["layers.1.attn.hook_pattern"].shape == (2, 4, 1, 6)  # one query, six keys
        full = model(x, need_weights=True).attentions[1][:, :, 5:]
        torch.testing.assert_close(got["layers.1.attn.hook_pattern"], full, atol=1e-6, rtol=0)
