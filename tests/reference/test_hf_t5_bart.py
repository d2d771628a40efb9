"""lmlab's encoder-decoder equals Hugging Face T5 (ReLU and gated-GELU) and BART.

Each reference model is built from a tiny config with random weights (nothing is downloaded),
its norm weights and biases moved off 1 / 0, converted through lmlab.interop.hf_t5 / hf_bart,
and compared in float32 to 1e-5: encoder output and logits on a batch with padding in both the
source and the target, cached incremental decoding, greedy generation against
``generate(do_sample=False, num_beams=1)``, the state dict round trip, and loading a saved folder.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab.generation.generate import SamplingParams  # noqa: E402
from lmlab.generation.seq2seq import generate_seq2seq  # noqa: E402
from lmlab.interop.hf_bart import (  # noqa: E402
    bart_hf_state_dict,
    bart_model_config,
    bart_state_dict,
)
from lmlab.interop.hf_t5 import t5_hf_state_dict, t5_model_config, t5_state_dict  # noqa: E402
from lmlab.interop.load import load  # noqa: E402
from lmlab.models import build_model  # noqa: E402
from lmlab.nn.position import relative_position_bucket  # noqa: E402
from tests.helpers import hf_config, redraw  # noqa: E402

VOCAB = 61


def t5_relu():
    # tie_word_embeddings: the decoder output is scaled by d_model**-0.5
    cfg = hf_config("t5", feed_forward_proj="relu", tie_word_embeddings=True)
    return transformers.T5ForConditionalGeneration, cfg, t5_model_config, t5_state_dict


def t5_gated():
    # tie_word_embeddings=False: transformers 5 still ties the head but drops the scaling
    cfg = hf_config("t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    return transformers.T5ForConditionalGeneration, cfg, t5_model_config, t5_state_dict


def bart():
    cfg = hf_config("bart")
    return transformers.BartForConditionalGeneration, cfg, bart_model_config, bart_state_dict


FAMILIES = {"t5_relu": t5_relu, "t5_gated_gelu": t5_gated, "bart": bart}
TO_HF = {"t5_relu": t5_hf_state_dict, "t5_gated_gelu": t5_hf_state_dict, "bart": bart_hf_state_dict}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    hf_cls, hf_cfg, to_cfg, to_state = FAMILIES[request.param]()
    torch.manual_seed(0)
    hf_model = redraw(hf_cls(hf_cfg))
    cfg = to_cfg(hf_cfg)
    ours = build_model(cfg).eval()
    ours.load_state_dict(to_state(hf_model.state_dict(), cfg), strict=True)
    return request.param, hf_model, ours


def _batch(pad: int):
    """Sources of 11, 7 and 4 tokens and decoder inputs of 9, 5 and 3, right-padded."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, VOCAB, (3, 11), generator=g)
    dec = torch.randint(3, VOCAB, (3, 9), generator=g)
    src_mask = torch.tensor([[1] * n + [0] * (11 - n) for n in (11, 7, 4)])
    dec_mask = torch.tensor([[1] * n + [0] * (9 - n) for n in (9, 5, 3)])
    return (
        src.masked_fill(src_mask == 0, pad),
        src_mask,
        dec.masked_fill(dec_mask == 0, pad),
        dec_mask,
    )


def test_encoder_output_and_logits_equal_with_padding_on_both_sides(pair):
    name, hf_model, ours = pair
    src, src_mask, dec, dec_mask = _batch(ours.cfg.seq2seq.pad_token_id)
    with torch.no_grad():
        ref = hf_model(
            input_ids=src,
            attention_mask=src_mask,
            decoder_input_ids=dec,
            decoder_attention_mask=dec_mask,
        )
        out = ours(
            src, attention_mask=src_mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        )
    real = src_mask.bool()
    torch.testing.assert_close(
        out.encoder_last_hidden_state[real], ref.encoder_last_hidden_state[real], atol=1e-5, rtol=0
    )
    dreal = dec_mask.bool()
    torch.testing.assert_close(out.logits[dreal], ref.logits[dreal], atol=1e-5, rtol=0)


def test_padding_tokens_never_change_the_real_logits(pair):
    _, _, ours = pair
    src, src_mask, dec, dec_mask = _batch(ours.cfg.seq2seq.pad_token_id)
    other = src.masked_fill(src_mask == 0, 5)  # different ids under the padding
    with torch.no_grad():
        a = ours(src, attention_mask=src_mask, decoder_input_ids=dec).logits
        b = ours(other, attention_mask=src_mask, decoder_input_ids=dec).logits
        alone = ours(src[2:, :4], decoder_input_ids=dec[2:, :3]).logits  # row 2 without padding
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(a[2:, :3], alone, atol=1e-5, rtol=0)


def test_cached_incremental_decoding_equals_full_recomputation(pair):
    _, hf_model, ours = pair
    src, src_mask, dec, _ = _batch(ours.cfg.seq2seq.pad_token_id)
    with torch.no_grad():
        full = ours(src, attention_mask=src_mask, decoder_input_ids=dec).logits
        ref = hf_model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
        cache = ours.new_cache()
        steps = [ours(src, attention_mask=src_mask, decoder_input_ids=dec[:, :4], cache=cache)]
        for t in range(4, dec.shape[1]):  # later steps: no source, the cross K/V are cached
            steps.append(ours(decoder_input_ids=dec[:, t : t + 1], cache=cache))
    cached = torch.cat([s.logits for s in steps], dim=1)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached, ref, atol=1e-5, rtol=0)
    assert steps[-1].encoder_last_hidden_state is None  # the encoder did not run again
    assert cache.seq_len == dec.shape[1] and cache.cross_filled


def test_greedy_generation_equals_hf_generate(pair):
    _, hf_model, ours = pair
    pad, eos = ours.cfg.seq2seq.pad_token_id, ours.cfg.seq2seq.eos_token_id
    src, src_mask, _, _ = _batch(pad)
    sources = [row[m.bool()].tolist() for row, m in zip(src, src_mask, strict=True)]
    n = 12
    with torch.no_grad():
        ref = hf_model.generate(
            input_ids=src, attention_mask=src_mask, do_sample=False, num_beams=1, max_new_tokens=n
        )
    expected = []
    for row in ref[:, 1:].tolist():  # drop the decoder start token; cut at EOS
        expected.append(row[: row.index(eos)] if eos in row else row)
    ours_out = generate_seq2seq(ours, sources, SamplingParams(max_new_tokens=n, temperature=0.0))
    assert ours_out == expected
    assert len({tuple(r) for r in expected}) > 1  # the target depends on the source


def test_state_dict_round_trip_is_bit_for_bit(pair):
    name, hf_model, ours = pair
    back = TO_HF[name](ours.state_dict(), ours.cfg)
    ref = hf_model.state_dict()
    assert set(back) == set(ref)
    for key, value in ref.items():
        assert torch.equal(back[key], value), key
    fresh = type(hf_model)(hf_model.config).eval()
    fresh.load_state_dict(back, strict=True)
    src, src_mask, dec, _ = _batch(ours.cfg.seq2seq.pad_token_id)
    with torch.no_grad():
        a = fresh(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
        b = hf_model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
    assert torch.equal(a, b)


def test_a_saved_hf_folder_loads_through_lmlab_load(pair, tmp_path):
    _, hf_model, ours = pair
    hf_model.save_pretrained(tmp_path)
    model, tokenizer = load(tmp_path)
    assert tokenizer is None and model.cfg.kind == "encoder_decoder"
    src, src_mask, dec, _ = _batch(ours.cfg.seq2seq.pad_token_id)
    with torch.no_grad():
        a = model(src, attention_mask=src_mask, decoder_input_ids=dec).logits
        b = hf_model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_equal_t5s(bidirectional):
    rel = torch.arange(-300, 301)[None, :]
    for nb, md in ((32, 128), (8, 12), (6, 20)):
        ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            rel, bidirectional=bidirectional, num_buckets=nb, max_distance=md
        )
        assert torch.equal(relative_position_bucket(rel, bidirectional, nb, md), ref)


VERIFY_CONFIGS = {
    "t5": {
        "kind": "encoder_decoder",
        "init": "normal",
        "attention": {"n_heads": 4, "scaled": False},
        "position": {"kind": "t5_relative", "num_buckets": 8, "max_distance": 16},
        "norm": {"kind": "rmsnorm", "eps": 1e-6},
        "ffn": {"kind": "gated", "activation": "gelu_tanh", "bias": False, "d_ff": 64},
        "seq2seq": {"n_decoder_layers": 3, "scale_decoder_output": True},
    },
    "bart": {
        "kind": "encoder_decoder",
        "final_norm": False,
        "attention": {"n_heads": 4, "bias": True},
        "position": {"kind": "learned", "offset": 2},
        "block": {"kind": "post"},
        "ffn": {"kind": "mlp", "activation": "gelu", "d_ff": 64},
        "seq2seq": {"embed_norm": True, "final_logits_bias": True, "scale_embedding": True},
    },
}


@pytest.mark.parametrize("family", list(VERIFY_CONFIGS))
def test_lmlab_verify_passes_on_encoder_decoder_configs_with_a_reference(family):
    from lmlab.analysis.verify import verify_config
    from tests.helpers import TINY, tiny_config

    cfg = tiny_config(model={**TINY["model"], **VERIFY_CONFIGS[family]})
    checks = {c.name: c for c in verify_config(cfg, family)}
    assert {n: c.status for n, c in checks.items()} == dict.fromkeys(checks, "pass")
    expected = "T5ForConditionalGeneration" if family == "t5" else "BartForConditionalGeneration"
    assert expected in checks["reference"].detail
