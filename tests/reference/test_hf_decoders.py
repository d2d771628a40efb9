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
from tests.helpers import hf_config, perturb_all, perturb_vectors  # noqa: E402


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
    cfg = hf_config("llama", num_key_value_heads=n_kv_heads, tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf_model = perturb_vectors(transformers.LlamaForCausalLM(cfg))  # RMSNorm weights start at 1
    ours = build_model(llama_model_config(cfg))
    ours.load_state_dict(llama_state_dict(hf_model.state_dict(), tied), strict=True)
    _compare(hf_model, ours, 97)


def test_gpt2_logits_match():
    cfg = hf_config("gpt2")
    torch.manual_seed(0)
    # biases and norm weights away from 0 / 1
    hf_model = perturb_all(transformers.GPT2LMHeadModel(cfg), 0.05)
    ours = build_model(gpt2_model_config(cfg))
    ours.load_state_dict(gpt2_state_dict(hf_model.state_dict(), 48), strict=True)
    _compare(hf_model, ours, 101)
