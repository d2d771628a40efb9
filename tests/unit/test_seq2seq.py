"""The encoder-decoder model and its components: T5 relative buckets, cross-attention, caches,
seq2seq generation, and a copy task that only cross-attention can solve."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.generation.generate import SamplingParams
from lmlab.generation.seq2seq import generate_seq2seq
from lmlab.models import build_model
from lmlab.nn.ffn import FFN
from lmlab.nn.position import relative_position_bucket
from tests.helpers import tiny_model_config

V = 37
T5_STYLE = dict(
    position={"kind": "t5_relative", "num_buckets": 8, "max_distance": 16},
    attention={"n_heads": 4, "scaled": False},
    norm={"kind": "rmsnorm"},
    ffn={"kind": "gated", "activation": "gelu_tanh", "bias": False},
    seq2seq={"scale_decoder_output": True, "n_decoder_layers": 3},
)
BART_STYLE = dict(
    block={"kind": "post"},
    position={"kind": "learned", "offset": 2},
    attention={"n_heads": 4, "bias": True},
    final_norm=False,
    seq2seq={"embed_norm": True, "final_logits_bias": True, "scale_embedding": True},
)
SINUSOIDAL = dict(position={"kind": "sinusoidal"}, attention={"n_heads": 4, "n_kv_heads": 2})
STYLES = {"t5": T5_STYLE, "bart": BART_STYLE, "sinusoidal_gqa": SINUSOIDAL}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is fastest, and on a shared 2-core machine the default
    threads spin against each other (100 training steps: 4 s instead of minutes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(style: dict, vocab: int = V, **extra) -> torch.nn.Module:
    cfg = tiny_model_config(vocab_size=vocab, kind="encoder_decoder", **{**style, **extra})
    cfg.seq2seq.pad_token_id, cfg.seq2seq.decoder_start_token_id, cfg.seq2seq.eos_token_id = 0, 1, 2
    return build_model(cfg).eval()


@pytest.fixture(params=list(STYLES))
def model(request):
    torch.manual_seed(0)
    return make(STYLES[request.param])


def test_relative_buckets_follow_t5s_scheme():
    rel = torch.tensor([0, 1, -1, 3, -3, 4, -4, 200, -200])
    # bidirectional, 16 buckets: 8 per direction, 4 exact; keys after the query in 8..15
    assert relative_position_bucket(rel, True, 16, 32).tolist() == [0, 9, 1, 11, 3, 12, 4, 15, 7]
    # causal: keys after the query all share bucket 0; far-back keys share the last bucket
    assert relative_position_bucket(rel, False, 16, 32).tolist() == [0, 0, 1, 0, 3, 0, 4, 0, 15]


def test_t5_bias_depends_on_the_offset_only_and_is_causal_in_the_decoder():
    m = make(T5_STYLE)
    enc, dec = m.encoder.position, m.decoder.position
    assert enc.bidirectional and not dec.bidirectional
    b = enc.score_bias(torch.arange(6), 6)  # (H, T, S)
    assert b.shape == (4, 6, 6)
    torch.testing.assert_close(b[:, 1, 2], b[:, 3, 4])  # same offset +1, same bias
    assert not torch.allclose(b[:, 2, 1], b[:, 2, 3])  # -1 and +1: different buckets
    d = dec.score_bias(torch.arange(2, 6), 6)  # cached: queries are the last 4 of 6 slots
    torch.testing.assert_close(d[:, 0, :3], dec.score_bias(torch.arange(3), 3)[:, 2])


def test_gated_ffn_is_the_glu_formula_with_the_configured_activation():
    cfg = tiny_model_config(vocab_size=V, ffn={"kind": "gated", "activation": "relu"})
    ffn = FFN.get("gated")(cfg)
    x = torch.randn(2, 3, 32)
    ref = ffn.down_proj(F.relu(ffn.gate_proj(x)) * ffn.up_proj(x))
    torch.testing.assert_close(ffn(x), ref)


def test_learned_offset_reads_row_p_plus_offset():
    m = make(BART_STYLE)
    pos = m.encoder.position
    assert pos.weight.shape == (32 + 2, 32)
    x = torch.zeros(1, 3, 32)
    torch.testing.assert_close(pos.embed(x, torch.arange(3))[0], pos.weight[2:5])


def test_shift_right_starts_with_the_start_id_and_pads_ignored_targets():
    m = make(T5_STYLE)
    targets = torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]])
    assert m.shift_right(targets).tolist() == [[1, 5, 6, 7], [1, 8, 2, 0]]


def test_the_encoder_sees_both_ways_and_the_decoder_only_back(model):
    src = torch.randint(3, V, (2, 9))
    dec = torch.randint(3, V, (2, 7))
    src2, dec2 = src.clone(), dec.clone()
    src2[:, -1] = (src2[:, -1] + 1) % V
    dec2[:, 4:] = (dec2[:, 4:] + 1) % V
    with torch.no_grad():
        a, b = model.encode(src), model.encode(src2)
        assert not torch.allclose(a[:, 0], b[:, 0])  # the first state sees the last token
        la = model(src, decoder_input_ids=dec).logits
        lb = model(src, decoder_input_ids=dec2).logits
    torch.testing.assert_close(la[:, :4], lb[:, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(la[:, 4:], lb[:, 4:])


def test_cross_attention_weights_cover_real_source_tokens_only(model):
    src = torch.randint(3, V, (2, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    dec = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        out = model(src, attention_mask=mask, decoder_input_ids=dec, need_weights=True)
        other = src.clone()
        other[1, 5:] = 3
        same = model(other, attention_mask=mask, decoder_input_ids=dec).logits
    n_dec = len(model.decoder.layers)
    assert len(out.cross_attentions) == n_dec and len(out.attentions) == n_dec
    assert len(out.encoder_attentions) == len(model.encoder.layers)
    for w in out.cross_attentions:
        assert w.shape == (2, 4, 6, 8)  # (B, H, T_dec, S_src)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
        assert float(w[1, :, :, 5:].abs().max()) == 0.0
    torch.testing.assert_close(out.logits, same, atol=1e-6, rtol=0)


def test_cached_decoding_equals_full_and_the_cross_cache_is_filled_once(model):
    src = torch.randint(3, V, (2, 9))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    dec = torch.randint(3, V, (2, 8))
    with torch.no_grad():
        full = model(src, attention_mask=mask, decoder_input_ids=dec).logits
        cache = model.new_cache()
        steps = [model(src, attention_mask=mask, decoder_input_ids=dec[:, :3], cache=cache).logits]
        k0 = cache.cross[0].k
        for t in range(3, 8):
            steps.append(model(decoder_input_ids=dec[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    assert cache.cross[0].k is k0  # never recomputed
    cfg = model.cfg
    per_token = 2 * 4 * cfg.n_kv_heads * cfg.head_dim  # k and v, float32, per layer and row
    n_dec = len(model.decoder.layers)
    assert cache.nbytes() == 2 * n_dec * per_token * (8 + 9)  # self (8 tokens) + cross (9)


def test_cached_generation_equals_uncached_greedy_and_sampled(model):
    sources = [[5, 6, 7, 8, 9], [10, 11, 12], [13]]
    for params in (
        SamplingParams(max_new_tokens=10, temperature=0.0),
        SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, seed=3),
    ):
        cached = generate_seq2seq(model, sources, params)
        assert cached == generate_seq2seq(model, sources, params, use_cache=False)
        assert all(len(r) <= 10 for r in cached)
    alone = generate_seq2seq(model, [sources[1]], SamplingParams(max_new_tokens=10, temperature=0))
    batch = generate_seq2seq(model, sources, SamplingParams(max_new_tokens=10, temperature=0))
    assert alone[0] == batch[1]  # padding in the batch changes nothing


def test_generation_stops_at_eos():
    m = make(BART_STYLE)
    with torch.no_grad():  # make EOS (id 2) the most likely token after the start token
        m.final_logits_bias[0, 2] = 1e4
    assert generate_seq2seq(m, [[5, 6], [7]], SamplingParams(temperature=0.0)) == [[], []]


@pytest.mark.parametrize("style", ["t5", "bart"])
def test_a_copy_task_trains_through_cross_attention(style):
    """Target = source (3 of 8 content tokens) + EOS. Without reading the source the best
    possible loss is uniform over the content tokens: 3/4 ln 8 = 1.56 nats/token (EOS is
    free). Falling well below that floor needs information from the encoder, which only the
    cross-attention carries."""
    torch.manual_seed(0)
    m = make(STYLES[style], vocab=11).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(100):
        src = torch.randint(3, 11, (32, 3), generator=g)
        tgt = torch.cat([src, torch.full((32, 1), 2)], dim=1)
        loss = m(src, targets=tgt).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:  # gradients reach the encoder through every cross-attention
            for layer in m.decoder.layers:
                assert float(layer.cross_attn.k_proj.weight.grad.abs().sum()) > 0
            assert float(m.encoder.layers[0].attn.q_proj.weight.grad.abs().sum()) > 0
        opt.step()
        losses.append(loss.item())
    floor = 3 / 4 * math.log(8)
    assert sum(losses[:5]) / 5 > floor  # starts above the no-source floor
    assert sum(losses[-10:]) / 10 < 0.75 * floor, losses[-10:]


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("tied", [True, False])
def test_closed_form_param_count_equals_the_built_model(style, tied):
    from lmlab.analysis.params import count_params

    m = make(STYLES[style], tie_embeddings=tied)
    parts = count_params(m.cfg)
    assert parts["total"] == m.num_params()
    assert parts["non_embedding"] == m.num_params(non_embedding=True)
