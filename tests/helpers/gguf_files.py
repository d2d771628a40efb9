"""Tiny Llama GGUF files for tests: a Hugging Face ``LlamaForCausalLM`` state dict stored
the way llama.cpp's converter stores it (q/k rows permuted to interleaved RoPE order), with a
byte-level vocabulary of the 256 byte tokens plus ``<|im_start|>`` / ``<|im_end|>``.

The permutation is written out here from llama.cpp's ``LlamaModel.permute`` formula, independent
of lmlab's :mod:`lmlab.interop.rope_layout`, so the tests check lmlab against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmlab.data.tokenizer import _unicode_to_byte

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokens() -> list[str]:
    """The 256 GPT-2 byte characters, in byte order, then the special tokens (ids 256, 257)."""
    table = _unicode_to_byte()
    by_byte = {b: c for c, b in table.items()}
    return [by_byte[b] for b in range(256)] + SPECIALS


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf ``permute`` (HF half-split rows -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_llama_gguf(
    path: Path,
    hf_model: Any,
    quant: Any = None,
    meta: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    permute: bool = True,
) -> Path:
    """Store ``hf_model`` (a LlamaForCausalLM) as a GGUF file. ``quant``: a GGMLQuantizationType
    for the 2-D weights (default F32); ``meta``: metadata overrides (value None removes a key);
    ``drop``: GGUF tensor names to leave out."""
    import gguf

    cfg = hf_model.config
    tokens = byte_tokens()
    kv: dict[str, Any] = {
        "llama.block_count": cfg.num_hidden_layers,
        "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads,
        "llama.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.chat_template": CHATML,
    }
    kv.update(meta or {})
    w = gguf.GGUFWriter(str(path), str(kv.pop("general.architecture", "llama")))
    for key, value in kv.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_merges([])
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    for key, value in hf_model.state_dict().items():
        value = value.detach().float()
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            parts = key.split(".")  # model.layers.{i}.{module...}.weight
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{HF_TO_GGUF[module]}.{parts[-1]}"
            if permute and module == "self_attn.q_proj":
                value = llama_cpp_permute(value, n_heads)
            elif permute and module == "self_attn.k_proj":
                value = llama_cpp_permute(value, n_kv)
        if name in drop:
            continue
        arr = value.numpy().astype(np.float32)
        if quant is not None and arr.ndim == 2:
            try:
                data = gguf.quants.quantize(arr, quant)
            except NotImplementedError:  # a type gguf cannot produce: zero bytes of its size
                data = np.zeros(gguf.quant_shape_to_byte_shape(arr.shape, quant), np.uint8)
            w.add_tensor(name, data, raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama_hf(n_layers: int = 1) -> Any:
    """A random-weight ``LlamaForCausalLM`` (vocab 258, width 32, 4 heads, 2 kv heads, context
    64, tied embeddings) in eval mode, for :func:`write_llama_gguf`. Needs transformers."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def write_tiny_gguf(folder: Path, n_layers: int = 2) -> Path:
    """:func:`tiny_llama_hf` with ``n_layers`` layers (64-token context, ChatML template) written
    as ``folder/tiny.gguf``. Needs transformers and gguf."""
    return write_llama_gguf(Path(folder) / "tiny.gguf", tiny_llama_hf(n_layers))
