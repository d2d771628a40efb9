"""lmlab's encoder equals Hugging Face BERT built from tiny configs with random weights.

Nothing is downloaded: BertForMaskedLM / BertModel are constructed from a BertConfig, converted
into lmlab through lmlab.interop.hf_bert, and compared in float32 (to 1e-5) on a padded batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from lmlab.interop.hf_bert import (  # noqa: E402
    bert_model_config,
    bert_state_dict,
    fit_bert_config,
    to_hf_bert_state_dict,
)
from lmlab.interop.load import load  # noqa: E402
from lmlab.models import build_model  # noqa: E402
from tests.helpers import hf_config, perturb_vectors  # noqa: E402

VOCAB = 61


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Move norm weights and biases off their 1 / 0 initial values, so a swapped or missing
    norm or bias would show."""
    return perturb_vectors(model).eval()


def _convert(hf_model: torch.nn.Module) -> torch.nn.Module:
    sd = hf_model.state_dict()
    cfg = fit_bert_config(bert_model_config(hf_model.config), sd)
    ours = build_model(cfg).eval()
    ours.load_state_dict(bert_state_dict(sd, cfg), strict=True)
    return ours


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (3, 13))
    mask = torch.ones_like(x)
    mask[1, 9:] = 0  # right padding, as BERT tokenizers pad
    mask[2, 4:] = 0
    types = torch.zeros_like(x)
    types[:, 6:] = 1  # a second segment
    return x, mask, types


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_for_masked_lm_hidden_states_and_logits_match(act: str):
    hf_model = _randomise(transformers.BertForMaskedLM(hf_config("bert", hidden_act=act)))
    ours = _convert(hf_model)
    assert ours.pooler is None and ours.lm_head is not None  # BertForMaskedLM: no pooler
    x, mask, types = _padded_batch()
    with torch.no_grad():
        ref = hf_model(x, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        got = ours(x, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    assert len(got.hidden_states) == len(ref.hidden_states) == 3
    for g, r in zip(got.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    # the padding matters: without the mask, the padded rows' real tokens change
    with torch.no_grad():
        unmasked = ours(x, token_type_ids=types).logits
    assert (unmasked[1, :9] - ref.logits[1, :9]).abs().max() > 1e-4  # 10x the tolerance


def test_bert_model_hidden_states_and_pooler_match():
    hf_model = _randomise(transformers.BertModel(hf_config("bert")))
    ours = _convert(hf_model)
    assert ours.lm_head is None and ours.pooler is not None  # BertModel: pooler, no MLM head
    x, mask, types = _padded_batch()
    with torch.no_grad():
        ref = hf_model(x, attention_mask=mask, token_type_ids=types)
        got = ours(x, attention_mask=mask, token_type_ids=types)
        torch.testing.assert_close(got.logits, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.pool(got.logits), ref.pooler_output, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls_name", ["BertForMaskedLM", "BertModel"])
def test_bert_state_dict_round_trip_is_bit_exact(cls_name: str):
    hf_model = _randomise(getattr(transformers, cls_name)(hf_config("bert")))
    sd = hf_model.state_dict()
    ours = _convert(hf_model)
    prefix = "bert." if cls_name == "BertForMaskedLM" else ""
    back = to_hf_bert_state_dict(ours.state_dict(), ours.cfg, prefix)
    assert set(back) == set(sd) - {"bert.embeddings.position_ids", "embeddings.position_ids"}
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k


def test_load_reads_a_bert_folder(tmp_path: Path):
    """lmlab.load on a HF BERT folder (config.json + model.safetensors) gives the same logits."""
    hf_model = _randomise(transformers.BertForMaskedLM(hf_config("bert")))
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    sd.pop("cls.predictions.decoder.weight")  # tied: HF saves shared tensors once
    sd.pop("cls.predictions.decoder.bias")
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    model, tokenizer = load(tmp_path)
    assert tokenizer is None
    x, mask, types = _padded_batch()
    with torch.no_grad():
        ref = hf_model(x, attention_mask=mask, token_type_ids=types).logits
        got = model(x, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
