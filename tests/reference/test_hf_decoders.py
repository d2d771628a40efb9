"""lmlab equals Hugging Face reference models built from tiny configs with random weights.

Nothing is downloaded (HF_HUB_OFFLINE=1): each model is constructed from a config, its weights
converted into lmlab through lmlab.interop.hf, and the logits compared in float32 (to 1e-5).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab.generation.generate import SamplingParams, generate_ids  # noqa: E402
from lmlab.interop.hf import (  # noqa: E402
    gpt2_model_config,
    gpt2_state_dict,
    llama_model_config,
    llama_state_dict,
)
from lmlab.models import build_model  # noqa: E402


def _compare(hf_model: torch.nn.Module, ours: torch.nn.Module, vocab: int) -> None:
    hf_model.eval()
    ours.eval()
    x = torch.randint(0, vocab, (2, 17))
    with torch.no_grad():
        ref = hf_model(x).logits
        got = ours(x).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        cache = ours.new_cache()  # cached decoding reproduces the reference too
        steps = [ours(x[:, :9], cache=cache).logits]
        steps += [ours(x[:, t : t + 1], cache=cache).logits for t in range(9, 17)]
        torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=1e-5)
        # a left-padded batch with an attention mask (positions 0..T-1 on both sides, as HF's
        # forward does by default): equal logits on the real tokens
        mask = torch.ones_like(x)
        mask[1, :6] = 0
        ref = hf_model(x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
        # greedy generation with the KV cache equals transformers' generate, token for token
        prompt = x[:1, :5]
        expected = hf_model.generate(
            prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, 5:].tolist()
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    got_ids = list(generate_ids(ours, prompt[0].tolist(), params, ours.cfg.max_seq_len))
    assert got_ids == expected


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_llama_logits_match(n_kv_heads: int, tied: bool):
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1: move them too
        for p in hf_model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    ours = build_model(llama_model_config(cfg))
    ours.load_state_dict(llama_state_dict(hf_model.state_dict(), tied), strict=True)
    _compare(hf_model, ours, 97)


def test_gpt2_logits_match():
    cfg = transformers.GPT2Config(
        vocab_size=101,
        n_positions=64,
        n_embd=48,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases and norm weights away from 0 / 1
    ours = build_model(gpt2_model_config(cfg))
    ours.load_state_dict(gpt2_state_dict(hf_model.state_dict(), 48), strict=True)
    _compare(hf_model, ours, 101)
