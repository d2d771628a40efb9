"""lmlab equals Hugging Face Mistral (sliding window), Qwen2 (q/k/v bias) and Qwen3 (QK-norm).

Each reference model is built from a tiny config with random weights (nothing is downloaded),
converted through lmlab.interop.hf_mistral, and compared in float32 to 1e-5: logits on random
inputs, on a left-padded batch with attention_mask (real tokens only), cached decoding, and greedy
generation token for token against ``generate(do_sample=False)``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab.interop.hf_mistral import (  # noqa: E402
    hf_state_dict,
    mistral_model_config,
    qwen2_model_config,
    qwen3_model_config,
    to_hf_state_dict,
)
from lmlab.models import build_model  # noqa: E402
from lmlab.nn.masks import position_ids_from_attention_mask  # noqa: E402
from tests.helpers import hf_config, perturb_vectors  # noqa: E402

VOCAB, T = 97, 17
TINY = dict(  # over tests.helpers.hf_models.LLAMA
    vocab_size=VOCAB,
    bos_token_id=None,
    eos_token_id=None,  # never stop generation early
    pad_token_id=0,
)


def _pair(hf_cls, hf_cfg, to_cfg):
    torch.manual_seed(0)
    hf_model = perturb_vectors(hf_cls(hf_cfg).eval())  # norm weights 1, biases 0 at init
    ours = build_model(to_cfg(hf_cfg)).eval()
    ours.load_state_dict(hf_state_dict(hf_model.state_dict(), tied=False), strict=True)
    return hf_model, ours


def mistral():
    cfg = hf_config("mistral", **TINY, sliding_window=5)  # window 5 < 17 tokens
    return _pair(transformers.MistralForCausalLM, cfg, mistral_model_config)


def qwen2():
    cfg = hf_config("qwen2", **TINY)
    return _pair(transformers.Qwen2ForCausalLM, cfg, qwen2_model_config)


def qwen2_sliding():
    cfg = hf_config("qwen2", **TINY, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    return _pair(transformers.Qwen2ForCausalLM, cfg, qwen2_model_config)


def qwen3():
    cfg = hf_config("qwen3", **TINY, head_dim=16)
    return _pair(transformers.Qwen3ForCausalLM, cfg, qwen3_model_config)


MODELS = {"mistral": mistral, "qwen2": qwen2, "qwen2_sliding": qwen2_sliding, "qwen3": qwen3}


def _left_padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, T) left-padded with token 0 to the longest length, and the (B, T) mask."""
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n :] = torch.randint(1, VOCAB, (n,))
        mask[i, t - n :] = 1
    return ids, mask


def test_converted_configs_carry_each_family_difference():
    assert mistral()[1].cfg.attention.mask == "sliding_window"
    assert mistral()[1].cfg.attention.window == 5
    q2 = qwen2()[1]
    assert (q2.cfg.attention.bias, q2.cfg.attention.out_bias) == (True, False)
    assert q2.layers[0].attn.o_proj.bias is None and q2.layers[0].attn.q_proj.bias is not None
    assert q2.cfg.attention.mask == "causal"
    assert qwen2_sliding()[1].cfg.attention.window == 6
    assert qwen3()[1].cfg.attention.qk_norm


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_full_and_cached(name):
    hf_model, ours = MODELS[name]()
    x = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf_model(x).logits
        torch.testing.assert_close(ours(x).logits, ref, atol=1e-5, rtol=1e-5)
        cache = ours.new_cache()  # prefill 9 (longer than the windows), then one at a time
        steps = [ours(x[:, :9], cache=cache).logits]
        steps += [ours(x[:, t : t + 1], cache=cache).logits for t in range(9, T)]
        torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("derive_positions", [False, True], ids=["positions_0_to_T", "from_mask"])
@pytest.mark.parametrize("name", list(MODELS))
def test_left_padded_batch_logits_match_on_real_tokens(name, derive_positions):
    """With position_ids None both count 0..T-1 over the padding (the HF forward convention);
    with position_ids from the mask both count real tokens only."""
    hf_model, ours = MODELS[name]()
    ids, mask = _left_padded([T, 11, 4])
    pos = position_ids_from_attention_mask(mask) if derive_positions else None
    with torch.no_grad():
        ref = hf_model(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask, position_ids=pos).logits
    assert torch.isfinite(got).all()
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_hf_generate_token_for_token(name):
    """Cached greedy decoding of a left-padded batch (positions from the mask, as HF generate
    derives them) produces HF generate(do_sample=False)'s tokens; 14 new tokens pass the window."""
    hf_model, ours = MODELS[name]()
    ids, mask = _left_padded([9, 6])
    new = 14
    with torch.no_grad():
        ref = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, min_new_tokens=new
        )[:, ids.shape[1] :]
        cache = ours.new_cache()
        pos = position_ids_from_attention_mask(mask)
        logits = ours(ids, cache=cache, attention_mask=mask, position_ids=pos).logits
        out = []
        for _ in range(new):
            tok = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out.append(tok)
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            pos = pos[:, -1:] + 1
            logits = ours(tok, cache=cache, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(torch.cat(out, 1), ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_converts_back_to_hf(name):
    hf_model, ours = MODELS[name]()
    back = to_hf_state_dict(ours.state_dict(), tied=False)
    reference = hf_model.state_dict()
    assert back.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(back[key], value), key
