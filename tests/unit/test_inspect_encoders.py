"""``lmlab inspect`` on the other model kinds: a BERT encoder and T5/BART encoder-decoders.

Parameters equal hand counts and the built models' tensors; FLOPs per token equal hand counts
and what torch's FLOP counter measures on the built model (forward, and for the encoder the
training step with the MLM head on the masked positions only); the encoder-decoder's KV cache
(self-attention per generated token + cross-attention per source token) equals what a real
cache holds after decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.analysis import costs
from lmlab.analysis.inspection import components, format_inspection, inspect_model
from lmlab.analysis.params import count_params
from lmlab.models import build_model
from tests.helpers import encoder_config
from tests.unit.test_seq2seq import STYLES, V, make

pytestmark = pytest.mark.usefixtures("one_thread")


def _bert(**model: object):
    """d 64, 2 layers, 4 heads, d_ff 256, V 100, 32 positions, biases, LayerNorm, Post-Norm."""
    return encoder_config(100, d_model=64, n_layers=2, max_seq_len=32, **model)


def _measured_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_bert_components_equal_a_hand_count_and_the_built_model():
    cfg = _bert()
    assert (cfg.d_ff, cfg.block.kind, cfg.tie_embeddings) == (256, "post", True)
    c = components(cfg)
    lin = 64 * 64 + 64  # a D x D linear with bias
    assert c == {
        "embedding": 100 * 64,
        "position": 32 * 64,
        "attention_q": 2 * lin,
        "attention_k": 2 * lin,
        "attention_v": 2 * lin,
        "attention_o": 2 * lin,
        "attention_norms": 0,
        "ffn": 2 * (64 * 256 + 256 + 256 * 64 + 64),
        "norms": 2 * 2 * 128 + 128,  # two LayerNorms per layer + the embedding LayerNorm
        "token_type": 2 * 64,
        "pooler": lin,
        "mlm_head": lin + 128 + 100,  # dense, LayerNorm, output bias (projection tied)
    }
    model = build_model(cfg)
    assert sum(c.values()) == sum(p.numel() for p in model.parameters())
    untied = _bert(tie_embeddings=False)
    assert components(untied)["mlm_head"] == lin + 128 + 100 + 100 * 64
    assert sum(components(untied).values()) == sum(
        p.numel() for p in build_model(untied).parameters()
    )


def test_bert_flops_per_token_equal_a_hand_count_and_torchs_flop_counter():
    cfg = _bert()
    w = 4 * 64 * 64 + 2 * 64 * 256  # q, k, v, o + the MLP, per layer
    head = 64 * 64 + 100 * 64  # MLM dense + the vocabulary projection
    forward = 2 * (2 * w + head) + 4 * 2 * 32 * 64
    assert costs.flops_per_token(cfg, 32) == forward == 233_984
    model = build_model(cfg).eval()
    x = torch.randint(5, 100, (1, 32))
    with torch.no_grad():
        measured = _measured_flops(lambda: model(x, need_weights=True))  # math attention
    assert measured == 32 * forward

    # training: forward + backward with the head on the 8 masked positions of 32 (p = 0.25)
    targets = torch.full_like(x, -100)
    targets[0, ::4] = x[0, ::4]
    model.train()

    def step() -> None:
        model(x, targets=targets, need_weights=True).loss.backward()

    train = costs.flops_per_token(cfg, 32, train=True, mask_prob=0.25)
    assert train == 3 * (forward - 2 * head) + 3 * 2 * head // 4
    assert _measured_flops(step) == 32 * train


@pytest.mark.parametrize("style", list(STYLES))
def test_encoder_decoder_components_add_cross_attention_and_equal_the_built_model(style: str):
    model = make(STYLES[style])
    cfg = model.cfg
    c = components(cfg)
    n = len(model.decoder.layers)
    assert n == (cfg.seq2seq.n_decoder_layers or cfg.n_layers)
    q_proj = model.encoder.layers[0].attn.q_proj
    per_q = q_proj.weight.numel() + (q_proj.bias.numel() if q_proj.bias is not None else 0)
    assert c["attention_q"] == (cfg.n_layers + n) * per_q  # encoder + decoder self-attention
    assert c["cross_attention_q"] == n * per_q
    built = {id(p): p for p in model.parameters()}
    assert sum(c.values()) == sum(p.numel() for p in built.values()) == count_params(cfg)["total"]
    cross = sum(p.numel() for name, p in model.named_parameters() if ".cross_attn." in name)
    assert cross == sum(c[f"cross_attention_{p}"] for p in "qkvo")


@pytest.mark.parametrize("style", list(STYLES))
def test_encoder_decoder_flops_per_pair_equal_torchs_flop_counter(style: str):
    model = make(STYLES[style])
    cfg = model.cfg
    src, tgt = torch.randint(3, V, (1, 9)), torch.randint(3, V, (1, 7))
    with torch.no_grad():
        measured = _measured_flops(lambda: model(src, decoder_input_ids=tgt, need_weights=True))
    assert costs.encoder_decoder_flops(cfg, 9, 7) == measured
    # per source + target token at seq_len T: the pair (T, T) over 2 T tokens
    t = cfg.max_seq_len
    assert costs.flops_per_token(cfg, t) == costs.encoder_decoder_flops(cfg, t, t) // (2 * t)
    assert costs.flops_per_token(cfg, t, train=True) == 3 * costs.flops_per_token(cfg, t)


def test_encoder_decoder_flops_equal_a_hand_count():
    """T5 style: the tiny config's d, L encoder and n = 3 decoder layers, gated FFN, MHA."""
    model = make(STYLES["t5"])
    cfg = model.cfg
    d, L, n, f, h = cfg.d_model, cfg.n_layers, 3, cfg.d_ff, cfg.attention.n_heads
    hd = cfg.head_dim
    da = h * hd
    w = 4 * d * da + 3 * d * f  # q k v o (MHA) + gate, up, down
    s, t = 10, 6
    hand = (
        s * (2 * L * w + 4 * L * s * da)  # encoder
        + s * 2 * n * 2 * d * da  # cross K, V of the encoder output
        + t * (2 * n * (w + 2 * d * da) + 4 * n * (t + s) * da)  # decoder
        + t * 2 * V * d  # LM head
    )
    assert costs.encoder_decoder_flops(cfg, s, t) == hand


@pytest.mark.parametrize("style", ["t5", "sinusoidal_gqa"])
def test_encoder_decoder_cache_formula_equals_a_real_cache(style: str):
    model = make(STYLES[style])
    cfg = model.cfg
    n = len(model.decoder.layers)
    src, dec = torch.randint(3, V, (2, 9)), torch.randint(3, V, (2, 5))
    cache = model.new_cache()
    with torch.no_grad():
        model(src, decoder_input_ids=dec, cache=cache)
    per_token = 2 * n * cfg.n_kv_heads * cfg.head_dim * 4
    assert costs.kv_cache_bytes_per_token(cfg, 4) == per_token
    assert costs.cross_cache_bytes_per_source_token(cfg, 4) == per_token
    assert cache.nbytes() == costs.kv_cache_bytes(cfg, 2, 5, 4, source_len=9)
    assert cache.nbytes() == 2 * (5 + 9) * per_token


def test_inspect_an_encoder_reports_no_kv_cache_and_its_own_parts(tmp_path: Path):
    path = tmp_path / "bert.yaml"
    path.write_text(
        "model: {kind: encoder, d_model: 64, n_layers: 2, max_seq_len: 32, vocab_size: 100,\n"
        "  attention: {n_heads: 4, mask: bidirectional, bias: true}, block: {kind: post},\n"
        "  position: {kind: learned}}\n"
        "data: {tokenizer: {kind: wordlevel, vocab_size: 100}}\n"
        "train: {objective: mlm}\n"
    )
    info = inspect_model(path)
    assert info["kind"] == "encoder"
    assert info["kv_cache_bytes_per_token"] == info["kv_cache_bytes"] == 0
    assert info["kv_cache_tokens_held"] == 0 and not info["kv_cache_bounded"]
    assert sum(info["components"].values()) == info["params_total"]
    assert info["flops_per_token_forward"] == 233_984
    assert {"token_type", "pooler", "mlm_head"} <= set(info["components"])
    text = format_inspection(info)
    assert "KV cache: none" in text and "mlm_head" in text


def test_inspect_an_encoder_decoder_adds_the_cross_attention_cache(tmp_path: Path):
    path = tmp_path / "t5.yaml"
    path.write_text(
        "model: {kind: encoder_decoder, d_model: 64, n_layers: 2, max_seq_len: 32,\n"
        "  vocab_size: 100, attention: {n_heads: 4, n_kv_heads: 2},\n"
        "  seq2seq: {n_decoder_layers: 3}}\n"
    )
    info = inspect_model(path, context=10, batch=2)
    # decoder self-attention: 2 (K, V) x 3 layers x 2 kv heads x 16 dims x 4 bytes
    assert info["kv_cache_bytes_per_token"] == 2 * 3 * 2 * 16 * 4 == 768
    assert info["kv_cache_cross_bytes_per_source_token"] == 768
    assert info["kv_cache_cross_bytes"] == 2 * 10 * 768
    assert info["kv_cache_bytes"] == 2 * 10 * 768 + 2 * 10 * 768
    assert info["kv_cache_bytes_per_token_per_layer"] == 256
    assert info["components"]["cross_attention_k"] == 3 * 64 * 32
    assert sum(info["components"].values()) == info["params_total"]
    assert "source + target" in info["flops_convention"]
    assert "cross-attention cache of a 10-token source" in format_inspection(info)


def test_inspect_bert_mini_counts_its_word_vocabulary():
    """A config without vocab_size is counted with its tokenizer's size: wordlevel 2048 here."""
    info = inspect_model(Path(__file__).resolve().parents[2] / "configs" / "bert-mini.yaml")
    assert info["vocab_size"] == 2048 and "wordlevel" in info["vocab_note"]
    assert info["components"]["embedding"] == 2048 * 128
    assert "MLM head's V x D projection is the embedding" in format_inspection(info)
