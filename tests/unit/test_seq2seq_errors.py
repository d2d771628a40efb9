"""Bad input to the encoder-decoder model, its config and seq2seq generation: one clear
LmlabError (or ConfigError) naming the thing at fault, never a torch traceback."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError, LmlabError
from lmlab.generation.generate import SamplingParams
from lmlab.generation.seq2seq import generate_seq2seq
from lmlab.interop.hf_bart import bart_model_config
from lmlab.interop.hf_t5 import t5_model_config, t5_state_dict
from lmlab.models import build_model
from tests.helpers import TINY, tiny_config, tiny_model_config


def seq2seq(**seq2seq_fields):
    cfg = tiny_model_config(vocab_size=20, kind="encoder_decoder")
    for k, v in seq2seq_fields.items():
        setattr(cfg.seq2seq, k, v)
    return build_model(cfg).eval()


def _config_error(model: dict) -> str:
    with pytest.raises(ConfigError) as e:
        tiny_config(model={**TINY["model"], **model})
    return str(e.value)


def test_generation_on_a_decoder_only_model_names_the_model_kind():
    m = build_model(tiny_model_config(vocab_size=20))
    with pytest.raises(LmlabError, match="model.kind=encoder_decoder"):
        generate_seq2seq(m, [[1, 2]])


def test_a_source_longer_than_the_encoder_context():
    m = seq2seq(decoder_start_token_id=0)
    with pytest.raises(LmlabError, match="longer than the encoder context"):
        generate_seq2seq(m, [[1] * 33])
    with pytest.raises(LmlabError, match="source has 33 tokens"):
        m(torch.ones(1, 33, dtype=torch.long), decoder_input_ids=torch.ones(1, 2, dtype=torch.long))


def test_empty_sources_bad_ids_and_stop_strings():
    m = seq2seq(decoder_start_token_id=0)
    with pytest.raises(LmlabError, match="at least one token"):
        generate_seq2seq(m, [[1], []])
    with pytest.raises(LmlabError, match="outside the vocabulary"):
        generate_seq2seq(m, [[1, 20]])
    with pytest.raises(LmlabError, match="stop strings need a tokenizer"):
        generate_seq2seq(m, [[1]], SamplingParams(stop=["."]))


def test_unset_special_ids_are_named():
    m = seq2seq()
    with pytest.raises(LmlabError, match="decoder_start_token_id is not set"):
        generate_seq2seq(m, [[1, 2]])
    with pytest.raises(LmlabError, match=r"model.seq2seq.decoder_start_token_id is not set"):
        m(torch.ones(1, 3, dtype=torch.long), targets=torch.ones(1, 2, dtype=torch.long))


def test_forward_without_decoder_input_or_source():
    m = seq2seq()
    with pytest.raises(LmlabError, match="decoder_input_ids or targets"):
        m(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(LmlabError, match="needs input_ids"):
        m(decoder_input_ids=torch.ones(1, 3, dtype=torch.long))


def test_config_rules_name_the_field():
    assert "model.seq2seq applies to model.kind=encoder_decoder" in _config_error(
        {"seq2seq": {"n_decoder_layers": 2}}
    )
    assert "model.block.kind" in _config_error(
        {"kind": "encoder_decoder", "block": {"kind": "hybrid"}}
    )
    assert "model.attention.mask" in _config_error(
        {"kind": "encoder_decoder", "attention": {"n_heads": 4, "mask": "bidirectional"}}
    )
    assert "model.position.num_buckets applies to kind=t5_relative" in _config_error(
        {"position": {"num_buckets": 16}}
    )
    assert "model.position.offset applies to kind=learned" in _config_error(
        {"position": {"offset": 2}}
    )
    assert "even and >= 4" in _config_error({"position": {"kind": "t5_relative", "num_buckets": 7}})
    assert "max_distance" in _config_error(
        {"position": {"kind": "t5_relative", "num_buckets": 32, "max_distance": 16}}
    )
    assert "must be < model.vocab_size" in _config_error(
        {"kind": "encoder_decoder", "vocab_size": 10, "seq2seq": {"eos_token_id": 10}}
    )


def test_hf_configs_lmlab_cannot_represent():
    from types import SimpleNamespace

    bart = SimpleNamespace(
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=8, decoder_ffn_dim=16
    )
    with pytest.raises(LmlabError, match="encoder_ffn_dim != decoder_ffn_dim"):
        bart_model_config(bart)
    t5 = SimpleNamespace(feed_forward_proj="gated-mish", vocab_size=10)
    with pytest.raises(LmlabError, match="gated-mish"):
        t5_model_config(t5)


def test_an_unexpected_t5_weight_is_named():
    cfg = tiny_model_config(vocab_size=20, kind="encoder_decoder")
    with pytest.raises(LmlabError, match="encoder.block.0.layer.0.SelfAttention.q.bias"):
        t5_state_dict({"encoder.block.0.layer.0.SelfAttention.q.bias": torch.zeros(2)}, cfg)
