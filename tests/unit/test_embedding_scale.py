"""Token-embedding scaling (``model.scale_embedding``): sqrt(d_model) by default under
sinusoidal positions, as in the original Transformer, so the amplitude-1 table does not drown
token embeddings initialised with std 0.02."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import AttentionConfig, ConfigError, ModelConfig, PositionConfig
from lmlab.interop.families import NotRepresentable, match_family
from lmlab.models.build import build_model
from lmlab.nn.position import sinusoidal_table
from tests.helpers import tiny_config, tiny_model_config


@torch.no_grad()
def embedding_output(kind: str, **model: object) -> tuple:
    """A tiny decoder's (first hidden state (1, T, D), token embeddings (1, T, D), positions
    (T,), config)."""
    cfg = tiny_model_config(position={"kind": kind}, **model)
    m = build_model(cfg).eval()
    ids = torch.randint(0, 50, (1, 10))
    out = m(ids, output_hidden_states=True)
    return out.hidden_states[0], m.embed(ids), torch.arange(10), cfg


def test_sinusoidal_scales_token_embeddings_by_sqrt_d_model():
    hidden, tokens, positions, cfg = embedding_output("sinusoidal")
    want = tokens * math.sqrt(cfg.d_model) + sinusoidal_table(positions, cfg.d_model)
    torch.testing.assert_close(hidden, want, rtol=0, atol=1e-6)
    # the token signal is no longer small next to the table (std 0.02 * sqrt(32) vs ~0.7)
    assert float((tokens * math.sqrt(cfg.d_model)).std()) > 0.1


def test_scale_embedding_false_keeps_the_unscaled_sum():
    hidden, tokens, positions, cfg = embedding_output("sinusoidal", scale_embedding=False)
    torch.testing.assert_close(hidden, tokens + sinusoidal_table(positions, cfg.d_model))


def test_other_positions_leave_embeddings_unscaled_unless_asked():
    hidden, tokens, _, _ = embedding_output("rope")
    assert torch.equal(hidden, tokens)
    hidden, tokens, _, cfg = embedding_output("rope", scale_embedding=True)
    torch.testing.assert_close(hidden, tokens * math.sqrt(cfg.d_model))


@torch.no_grad()
def test_encoder_scales_before_the_embedding_norm():
    cfg = ModelConfig(
        kind="encoder",
        vocab_size=50,
        d_model=32,
        n_layers=1,
        type_vocab_size=0,
        attention=AttentionConfig(n_heads=4, mask="bidirectional"),
        position=PositionConfig(kind="sinusoidal"),
    )
    m = build_model(cfg).eval()
    ids = torch.randint(0, 50, (1, 10))
    hidden = m(ids, output_hidden_states=True).hidden_states[0]
    want = m.embed_norm(m.embed(ids) * math.sqrt(32) + sinusoidal_table(torch.arange(10), 32))
    torch.testing.assert_close(hidden, want)


def test_encoder_decoder_refuses_model_scale_embedding():
    with pytest.raises(ConfigError, match="model.seq2seq.scale_embedding"):
        tiny_config(model={"kind": "encoder_decoder", "scale_embedding": True})


def test_export_refuses_scaled_embeddings():
    cfg = tiny_model_config(scale_embedding=True)
    with pytest.raises(NotRepresentable, match="scale_embedding"):
        match_family(cfg)
