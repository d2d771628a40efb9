"""EncoderLM (BERT): bidirectional attention, padding, heads, parameter counts, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.analysis.params import count_params
from lmlab.config import ConfigError, config_from_dict
from lmlab.models import build_model
from tests.helpers import ENCODER, encoder_config


def test_encoder_is_bidirectional_a_later_token_changes_earlier_outputs():
    model = build_model(encoder_config()).eval()
    x = torch.randint(5, 50, (1, 10))
    y = x.clone()
    y[0, 9] = (x[0, 9] + 1) % 50
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-4  # position 0 sees position 9


@pytest.mark.parametrize("block", ["post", "pre"])
def test_padding_keys_are_ignored_a_padded_row_equals_the_row_alone(block: str):
    model = build_model(encoder_config(block={"kind": block})).eval()
    x = torch.randint(5, 50, (1, 7))
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 4)], 1).long()
    with torch.no_grad():
        alone = model(x).logits
        batch = model(padded, attention_mask=mask).logits
        unmasked = model(padded).logits
    torch.testing.assert_close(batch[:, :7], alone, atol=1e-5, rtol=1e-5)
    assert (unmasked[:, :7] - alone).abs().max() > 1e-4  # without the mask the pads are seen


def test_mlm_loss_is_the_cross_entropy_at_the_masked_positions_only():
    model = build_model(encoder_config()).eval()
    x = torch.randint(5, 50, (2, 8))
    targets = torch.full_like(x, -100)
    targets[0, 2], targets[1, 5] = 7, 9
    with torch.no_grad():
        out = model(x, targets=targets)
        full = model(x).logits  # (B, T, V): every position, without targets
    logp = F.log_softmax(full.float(), -1)
    expected = -(logp[0, 2, 7] + logp[1, 5, 9]) / 2
    torch.testing.assert_close(out.loss, expected)
    # with targets the head ran on the 2 masked positions only, in row-major order
    assert out.logits.shape == (2, 50)
    torch.testing.assert_close(out.logits, full[[0, 1], [2, 5]])


def test_mlm_decoder_is_tied_to_the_token_embedding_and_has_a_bias():
    model = build_model(encoder_config())
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.bias is not None and model.lm_head.bias.shape == (50,)
    untied = build_model(encoder_config(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight


def test_token_types_change_the_output_and_pooler_is_tanh_of_the_first_token():
    model = build_model(encoder_config()).eval()
    x = torch.randint(5, 50, (1, 6))
    types = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        a = model(x, output_hidden_states=True)
        b = model(x, token_type_ids=types)
        pooled = model.pool(a.hidden_states[-1])
    assert (a.logits[0, 3:] - b.logits[0, 3:]).abs().max() > 1e-4
    expected = torch.tanh(a.hidden_states[-1][:, 0] @ model.pooler.weight.T + model.pooler.bias)
    torch.testing.assert_close(pooled, expected)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"block": {"kind": "pre"}},
        {"pooler": False, "mlm_head": False},
        {"tie_embeddings": False, "type_vocab_size": 0},
        {"position": {"kind": "rope"}},
    ],
)
def test_closed_form_parameter_count_equals_the_built_encoder(fields: dict):
    cfg = encoder_config(**fields)
    model = build_model(cfg)
    assert count_params(cfg)["total"] == model.num_params()
    assert count_params(cfg)["non_embedding"] == model.num_params(non_embedding=True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model": {"kind": "encoder"}}, "model.kind=encoder needs model.attention.mask"),
        ({"model": {"type_vocab_size": 3}}, "model.type_vocab_size applies to model.kind=encoder"),
        ({"train": {"objective": "mlm"}}, "train.objective=mlm needs model.kind encoder"),
        (
            {"model": {"kind": "encoder", "attention": {"mask": "bidirectional"}}},
            "needs a tokenizer with a [MASK] token",
        ),
        ({**ENCODER, "train": {"mask_prob": 1.5}}, "train.mask_prob must be in (0, 1)"),
        ({"train": {"whole_word_mask": True}}, "train.whole_word_mask applies to"),
        ({**ENCODER, "train": {"objective": "clm"}}, "train.objective=clm needs model.kind"),
        ({"data": {"tokenizer": {"special_tokens": "xx"}}}, "data.tokenizer.special_tokens"),
    ],
)
def test_bad_encoder_configs_name_the_field(data: dict, message: str):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data).validate()
    assert message in str(e.value)


def test_encoder_config_defaults_to_the_mlm_objective():
    from lmlab.training.objectives import objective_name

    assert objective_name(config_from_dict(ENCODER).validate()) == "mlm"
    assert objective_name(config_from_dict({}).validate()) == "clm"


def test_verify_skips_causality_and_kv_cache_for_an_encoder_and_checks_the_rest():
    from pathlib import Path

    from lmlab.analysis.verify import verify

    root = Path(__file__).resolve().parents[2] / "configs"
    checks = {c.name: c.status for c in verify(str(root / "bert-mini.yaml"))}
    assert checks == {
        "causality": "skip",
        "kv_cache": "skip",
        "gradients": "pass",  # the pooler included, though MLM alone does not train it
        "state_dict": "pass",
        "reference": "skip",
    }
