"""Tiny random-weight Hugging Face models for the reference tests: one base config per family
(a few thousand parameters, nothing downloaded), the perturbations that move weights off their
initial values so a wrong map cannot hide behind a 1 or a 0, and a writer of HF model folders.

``transformers`` is imported inside each function: a test module that needs it calls
``pytest.importorskip("transformers")`` first.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

# Llama and the families that share its layout (Mistral, Mixtral, Qwen2, Qwen3): width 64,
# 4 heads of 16, 2 kv heads, RoPE base 500 (so short contexts still rotate visibly).
LLAMA: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)
GPT2: dict[str, Any] = dict(
    vocab_size=101,
    n_positions=64,
    n_embd=48,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
# Pythia-like: a quarter of each 16-channel head rotated, sequential residual unless overridden.
GPT_NEOX: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
    rotary_pct=0.25,
    rotary_emb_base=500,
    use_parallel_residual=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
BERT: dict[str, Any] = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=24,
    type_vocab_size=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
T5: dict[str, Any] = dict(
    vocab_size=61,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_decoder_layers=2,  # transformers 5.24's generate sizes T5's cache by num_layers
    num_heads=4,
    relative_attention_num_buckets=8,  # few buckets, short max distance: the log buckets are used
    relative_attention_max_distance=12,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
BART: dict[str, Any] = dict(
    vocab_size=61,
    d_model=32,
    encoder_layers=2,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=40,
    scale_embedding=True,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=None,
)

# family -> (transformers config class, base settings)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", LLAMA),
    "mistral": ("MistralConfig", LLAMA),
    "mixtral": ("MixtralConfig", LLAMA),
    "qwen2": ("Qwen2Config", LLAMA),
    "qwen3": ("Qwen3Config", LLAMA),
    "gpt2": ("GPT2Config", GPT2),
    "gpt_neox": ("GPTNeoXConfig", GPT_NEOX),
    "bert": ("BertConfig", BERT),
    "t5": ("T5Config", T5),
    "bart": ("BartConfig", BART),
}


def hf_config(family: str, **overrides: Any) -> Any:
    """The tiny ``transformers`` config of ``family`` (a key of :data:`FAMILIES`), keyword
    settings overriding the base ones (``hf_config("llama", num_key_value_heads=1)``)."""
    import transformers

    cls_name, base = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**copy.deepcopy(base), **overrides})


def perturb_vectors(model: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Add N(0, ``scale``) noise to every 1-D parameter in place (norm weights start at 1 and
    biases at 0: a swapped or missing norm or bias then shows). Returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * scale)
    return model


def perturb_all(model: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Add N(0, ``scale``) noise to every parameter in place. Returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def redraw(model: torch.nn.Module) -> torch.nn.Module:
    """Redraw every matrix N(0, 0.2) (HF's init gives near-constant greedy outputs: the same
    token over and over, or an immediate EOS) and move norm weights and biases (1 / 0 at init,
    final_logits_bias included) by N(0, 0.1), so no map can hide behind an initial value.
    Returns ``model`` in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.2)
        for name, buf in model.named_buffers():
            if name == "final_logits_bias":
                buf.add_(torch.randn_like(buf) * 0.1)
    return model.eval()


def write_hf_folder(folder: Path, model: Any, tokenizer: Any = None) -> Path:
    """Save ``model`` (a ``transformers`` model) with ``save_pretrained`` into ``folder``
    (config.json + model.safetensors), and ``tokenizer`` (an lmlab tokenizer, optional) as its
    tokenizer.json. Returns ``folder``."""
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save(Path(folder) / "tokenizer.json")
    return Path(folder)
