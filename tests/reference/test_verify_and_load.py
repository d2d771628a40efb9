"""lmlab verify proves (and can refute) a config; lmlab.load reads Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lmlab  # noqa: E402
from lmlab.analysis.verify import verify  # noqa: E402
from lmlab.cli import main  # noqa: E402

LLAMA_YAML = """
model:
  d_model: 64
  n_layers: 2
  norm: {kind: rmsnorm, eps: 1.0e-6}
  ffn: {kind: swiglu, d_ff: 96, bias: false}
  attention: {n_heads: 4, n_kv_heads: 2}
"""


def test_verify_passes_a_llama_config_including_the_reference(tmp_path: Path, capsys):
    cfg = tmp_path / "llama.yaml"
    cfg.write_text(LLAMA_YAML)
    checks = {c.name: c for c in verify(str(cfg))}
    assert {n: c.status for n, c in checks.items()} == {
        "causality": "pass",
        "kv_cache": "pass",
        "gradients": "pass",
        "state_dict": "pass",
        "reference": "pass",
    }
    assert "LlamaForCausalLM" in checks["reference"].detail
    assert main(["verify", "--config", str(cfg)]) == 0
    assert "0 failed" in capsys.readouterr().out


def test_verify_catches_a_model_that_sees_the_future(tmp_path: Path, capsys, monkeypatch):
    from lmlab.nn.masks import MASKS

    cfg = tmp_path / "leaky.yaml"
    cfg.write_text(LLAMA_YAML.replace("n_kv_heads: 2}", "n_kv_heads: 2, backend: math}"))

    def no_mask(t, s, device=None, window=None):
        return torch.ones(t, s, dtype=torch.bool)

    monkeypatch.setitem(MASKS._items, "causal", no_mask)
    checks = {c.name: c.status for c in verify(str(cfg))}
    assert checks["causality"] == "FAIL"
    assert main(["verify", "--config", str(cfg)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_every_shipped_preset():
    checks = verify()
    assert {c.config for c in checks} >= {"minigpt", "tiny"}
    assert not [c for c in checks if c.status == "FAIL"], [c for c in checks if c.status == "FAIL"]


def test_verify_says_why_an_encoder_has_no_reference_check():
    # BERT folders load into lmlab, but lmlab writes no BertConfig: the skip names that (it read
    # "no Hugging Face counterpart ()" while the family was filed under the decoder kind)
    preset = Path(__file__).resolve().parents[2] / "configs" / "bert-mini.yaml"
    (check,) = [c for c in verify(str(preset)) if c.name == "reference"]
    assert check.status == "skip"
    assert "bert: lmlab reads its Hugging Face folders, but writes no config" in check.detail


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_a_hugging_face_folder(tmp_path: Path, family: str):
    torch.manual_seed(0)
    if family == "llama":
        hf_cfg = transformers.LlamaConfig(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        hf_model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.GPT2Config(
            vocab_size=90, n_positions=32, n_embd=32, n_layer=2, n_head=4
        )
        hf_model = transformers.GPT2LMHeadModel(hf_cfg)
    hf_model.save_pretrained(tmp_path)  # a local folder: config.json + model.safetensors
    model, tokenizer = lmlab.load(tmp_path)
    assert tokenizer is None
    x = torch.randint(0, 90, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf_model.eval()(x).logits, atol=1e-5, rtol=1e-5)


def test_load_refuses_unknown_folders(tmp_path: Path):
    with pytest.raises(lmlab.errors.LmlabError, match="neither an lmlab run folder"):
        lmlab.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')  # bert is supported now
    with pytest.raises(lmlab.errors.LmlabError, match="model_type 'mamba' is not supported"):
        lmlab.load(tmp_path)


def test_load_a_run_folder(tiny_run: Path):
    model, tokenizer = lmlab.load(tiny_run)
    assert tokenizer is not None and tokenizer.vocab_size == 65
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 65)
