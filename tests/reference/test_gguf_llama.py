"""GGUF files of a Llama model load into lmlab with the reference model's logits.

A tiny random Hugging Face ``LlamaForCausalLM`` is written to a GGUF file the way llama.cpp's
converter writes one (q/k rows permuted to interleaved RoPE order, tests/helpers/gguf_files.py);
lmlab reads it back through ``lmlab.load``. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import lmlab.interop.gguf as lmlab_gguf  # noqa: E402
from lmlab.interop.load import load  # noqa: E402
from lmlab.interop.rope_layout import (  # noqa: E402
    gguf_permute,
    gguf_unpermute,
    half_split_to_interleaved,
    interleaved_to_half_split,
)
from lmlab.models import build_model  # noqa: E402
from tests.helpers import (  # noqa: E402
    hf_config,
    llama_cpp_permute,
    tiny_model_config,
    write_llama_gguf,
)

VOCAB = 258  # 256 byte tokens + <|im_start|> + <|im_end|>


def hf_llama(n_kv_heads: int = 2, tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = hf_config(
        "llama",
        vocab_size=VOCAB,
        num_key_value_heads=n_kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen attention so RoPE's pairing moves the logits visibly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


# ------------------------------------------------------------------ rope_layout, no file


@pytest.mark.parametrize("n_heads", [1, 3])
def test_gguf_permute_is_llama_cpp_formula_and_unpermute_inverts_it(n_heads: int):
    w = torch.randn(n_heads * 8, 5)
    torch.testing.assert_close(gguf_permute(w, n_heads), llama_cpp_permute(w, n_heads))
    torch.testing.assert_close(gguf_unpermute(gguf_permute(w, n_heads), n_heads), w)
    assert not torch.equal(gguf_permute(w, n_heads), w)  # it does move rows


def test_half_split_to_interleaved_pairs_channel_i_with_i_plus_half():
    w = torch.arange(8.0).unsqueeze(1)  # one head, hd 8: row j holds j
    assert half_split_to_interleaved(w, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    partial = half_split_to_interleaved(w, 1, rotary_dim=4).flatten().tolist()
    assert partial == [0, 2, 1, 3, 4, 5, 6, 7]  # channels past r stay in place
    torch.testing.assert_close(interleaved_to_half_split(half_split_to_interleaved(w, 1), 1), w)


def test_interleaved_lmlab_model_equals_half_split_one_after_conversion():
    half = build_model(tiny_model_config(37, attention={"n_heads": 4, "n_kv_heads": 2})).eval()
    inter_cfg = tiny_model_config(
        37, attention={"n_heads": 4, "n_kv_heads": 2}, position={"interleaved": True}
    )
    inter = build_model(inter_cfg).eval()
    with torch.no_grad():
        for layer in half.layers:
            layer.attn.q_proj.weight.mul_(20)
            layer.attn.k_proj.weight.mul_(20)
    sd = half.state_dict()
    for key in sd:
        if key.endswith("attn.q_proj.weight"):
            sd[key] = half_split_to_interleaved(sd[key], 4)
        elif key.endswith("attn.k_proj.weight"):
            sd[key] = half_split_to_interleaved(sd[key], 2)
    inter.load_state_dict(sd)
    x = torch.randint(0, 37, (2, 13))
    torch.testing.assert_close(logits(inter, x), logits(half, x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ a GGUF file


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gguf_file_loads_with_hf_logits(tmp_path: Path, n_kv_heads: int, tied: bool):
    hf = hf_llama(n_kv_heads, tied)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf)
    model, tok = load(path)
    assert model.cfg.tie_embeddings is tied
    assert model.cfg.n_kv_heads == n_kv_heads
    x = torch.randint(0, VOCAB, (2, 21))
    torch.testing.assert_close(logits(model, x), logits(hf, x), atol=1e-5, rtol=1e-5)


def test_gguf_without_unpermute_differs_from_hf(tmp_path: Path, monkeypatch):
    """The unpermute is what makes the logits equal: skipped, they differ (not just a bit)."""
    hf = hf_llama()
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf)
    x = torch.randint(0, VOCAB, (2, 21))
    monkeypatch.setattr(lmlab_gguf, "gguf_unpermute", lambda w, n_heads: w)
    model, _ = load(path)
    assert (logits(model, x) - logits(hf, x)).abs().max() > 1e-2


def test_gguf_q8_0_dequantized_close_to_hf(tmp_path: Path):
    """Quantized tensors go through gguf's own dequantize: Q8_0 keeps logits close (not equal)."""
    hf = hf_llama()
    path = write_llama_gguf(tmp_path / "q8.gguf", hf, quant=gguf.GGMLQuantizationType.Q8_0)
    model, _ = load(path)
    x = torch.randint(0, VOCAB, (1, 16))
    ref = logits(hf, x)
    err = (logits(model, x) - ref).abs().max()
    assert 0 < err < 0.05 * ref.abs().max()
