"""lmlab export / import against transformers: exported folders load with from_pretrained and
give lmlab's logits; imported Hugging Face folders score text as transformers does; and
HF -> import -> export -> HF gives back every weight bit for bit.

Every model is built from a tiny config with random weights (norm weights and biases moved off
their 1 / 0 initial values, so no map can hide); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from lmlab.cli import main  # noqa: E402
from lmlab.config import load_config  # noqa: E402
from lmlab.data.tokenizer import CharTokenizer  # noqa: E402
from lmlab.evaluation.evaluate import evaluate  # noqa: E402
from lmlab.interop.export import export_model, verify_hf_folder  # noqa: E402
from lmlab.interop.importer import import_model, write_run  # noqa: E402
from lmlab.interop.load import load as lmlab_load  # noqa: E402
from lmlab.models import build_model  # noqa: E402
from lmlab.run import load_run  # noqa: E402
from tests.helpers import perturb_all, tiny_model_config, write_hf_folder  # noqa: E402

VOCAB = 61
CHARS = [chr(0x21 + i) for i in range(VOCAB)]  # '!' .. ']'

LLAMA = {
    "norm": {"kind": "rmsnorm", "eps": 1e-6},
    "ffn": {"kind": "swiglu", "d_ff": 48, "bias": False},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
    "tie_embeddings": False,
}
FAMILIES = {  # model_type -> tiny lmlab model settings it must export to
    "gpt2": {
        "position": {"kind": "learned"},
        "attention": {"n_heads": 4, "bias": True},
        "ffn": {"kind": "mlp", "activation": "gelu_tanh", "bias": True},
    },
    "gpt_neox": {  # Pythia-like: parallel block, partial rotary, untied, biases
        "attention": {"n_heads": 4, "bias": True},
        "position": {"kind": "rope", "partial_rotary_factor": 0.5, "rope_theta": 500.0},
        "block": {"parallel": True},
        "tie_embeddings": False,
    },
    "llama": LLAMA,
    "mistral": {**LLAMA, "attention": {"n_heads": 4, "mask": "sliding_window", "window": 6}},
    "mixtral": {
        **LLAMA,
        "ffn": {"kind": "moe", "d_ff": 24, "bias": False, "n_experts": 4, "top_k": 2},
    },
    "qwen2": {
        **LLAMA,
        "attention": {"n_heads": 4, "n_kv_heads": 2, "bias": True, "out_bias": False},
    },
    "qwen3": {**LLAMA, "attention": {"n_heads": 4, "qk_norm": True}, "tie_embeddings": True},
}


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    return perturb_all(model).eval()


def _lmlab_run(tmp_path: Path, **model_settings) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = _randomise(build_model(tiny_model_config(VOCAB, **model_settings)))
    run = write_run(model, CharTokenizer(CHARS), tmp_path / "run")
    return run, model


def _assert_hf_equals(out: Path, model: torch.nn.Module, hf_class: str, t: int = 23) -> None:
    """from_pretrained(out) is ``hf_class`` and computes ``model``'s logits (fresh input)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    x = torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, model_type: str):
    run, model = _lmlab_run(tmp_path, **FAMILIES[model_type])
    res = export_model(run, tmp_path / "hf")
    assert res.model_type == model_type
    assert res.max_abs_diff is not None and res.max_abs_diff <= 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [res.hf_class]
    if model_type != "gpt2":  # transformers 5 keeps RoPE settings in rope_parameters
        assert config["rope_parameters"]["rope_type"] == "default"
        assert "rope_theta" not in config and "rope_scaling" not in config
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert ("lm_head.weight" in tensors) == (not model.cfg.tie_embeddings)
    _assert_hf_equals(tmp_path / "hf", model, res.hf_class)
    # the tokenizer loads with AutoTokenizer and encodes as lmlab's does
    ours = CharTokenizer(CHARS).encode("ABC!]")
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        tok = cls.from_pretrained(str(tmp_path / "hf"))
        assert tok.encode("ABC!]", add_special_tokens=False) == ours
        assert tok.decode(ours) == "ABC!]"


def test_the_default_minigpt_exports_as_gpt_neox(tmp_path: Path, capsys):
    """configs/minigpt.yaml at tiny sizes -> GPTNeoXForCausalLM, through the CLI."""
    cfg = load_config(
        "configs/minigpt.yaml",
        ["model.d_model=32", "model.n_layers=2", "model.max_seq_len=32", "model.vocab_size=61"],
    )
    torch.manual_seed(0)
    model = _randomise(build_model(cfg.model))
    run = write_run(model, CharTokenizer(CHARS), tmp_path / "run")
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "GPTNeoXForCausalLM" in out and "max |logit diff|" in out
    _assert_hf_equals(tmp_path / "hf", model, "GPTNeoXForCausalLM")


def test_the_export_check_refutes_a_folder_with_other_weights(tmp_path: Path):
    """The self-check is not vacuous: a model whose weights differ from the folder's fails."""
    run, model = _lmlab_run(tmp_path, **FAMILIES["llama"])
    export_model(run, tmp_path / "hf")
    with torch.no_grad():
        model.layers[1].ffn.down_proj.weight[0, 0] += 0.5
    with pytest.raises(Exception, match="different logits"):
        verify_hf_folder(tmp_path / "hf", model, None)


def test_export_without_transformers_says_it_skipped_the_check(tmp_path: Path, monkeypatch):
    import importlib

    real = importlib.import_module

    def no_transformers(name: str, *a):
        if name == "transformers":
            raise ImportError(name)
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", no_transformers)
    run, _ = _lmlab_run(tmp_path, **FAMILIES["gpt2"])
    res = export_model(run, tmp_path / "hf")
    assert res.max_abs_diff is None and "skipped" in res.verify_note
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# ----------------------------------------------------------------- HF folders -> import


def _hf_folder(tmp_path: Path, model_type: str) -> tuple[Path, torch.nn.Module]:
    """A tiny random Hugging Face model of ``model_type``, saved with save_pretrained, with a
    character tokenizer.json of VOCAB tokens."""
    common = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None}
    llama = {
        **common,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "pad_token_id": None,
    }
    configs = {
        "gpt2": transformers.GPT2Config(
            **common, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=48
        ),
        "gpt2_untied": transformers.GPT2Config(  # a head of its own (tie_word_embeddings false)
            **common,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_inner=48,
            tie_word_embeddings=False,
        ),  # fmt: skip
        "gpt_neox": transformers.GPTNeoXConfig(
            **common,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=32,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            tie_word_embeddings=False,
        ),
        "llama": transformers.LlamaConfig(**llama, tie_word_embeddings=True),
        "mistral": transformers.MistralConfig(**llama, sliding_window=8),
        "mixtral": transformers.MixtralConfig(**llama, num_local_experts=4, sliding_window=None),
        "qwen2": transformers.Qwen2Config(**llama, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**llama, head_dim=16, tie_word_embeddings=False),
    }
    torch.manual_seed(0)
    hf = _randomise(transformers.AutoModelForCausalLM.from_config(configs[model_type]))
    folder = tmp_path / f"hf-{model_type}"
    return write_hf_folder(folder, hf, CharTokenizer(CHARS)), hf


@pytest.mark.parametrize(
    "model_type",
    ["gpt2", "gpt2_untied", "gpt_neox", "llama", "mistral", "mixtral", "qwen2", "qwen3"],
)
def test_hf_import_export_round_trip_gives_back_every_weight(tmp_path: Path, model_type: str):
    folder, hf = _hf_folder(tmp_path, model_type)
    import_model(folder, tmp_path / "run")
    export_model(tmp_path / "run", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert type(back) is type(hf)
    ref, got = hf.state_dict(), back.state_dict()
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
    if model_type == "gpt2_untied":  # the head stayed its own, and lmlab computes HF's logits
        assert not torch.equal(ref["lm_head.weight"], ref["transformer.wte.weight"])
        model, _ = lmlab_load(folder)
        x = torch.randint(0, VOCAB, (2, 9))
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, hf.eval()(x).logits, atol=1e-5, rtol=1e-5)


def test_an_imported_hf_model_evaluates_as_transformers_scores_it(tmp_path: Path, capsys):
    folder, hf = _hf_folder(tmp_path, "llama")
    assert main(["import", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert "wrote run" in capsys.readouterr().out
    assert load_run(tmp_path / "run").step == 0
    text = "".join(CHARS[(7 * i) % VOCAB] for i in range(30))  # 30 tokens: one window
    (tmp_path / "t.txt").write_text(text)
    res = evaluate(str(tmp_path / "run"), data=str(tmp_path / "t.txt"), device="cpu")
    ids = torch.tensor([CharTokenizer(CHARS).encode(text)])
    with torch.no_grad():
        logits = hf(ids).logits[0, :-1]
    expected = float(F.cross_entropy(logits, ids[0, 1:]))
    assert res.tokens == 29
    assert math.isclose(res.loss, expected, rel_tol=1e-5)


@pytest.mark.parametrize(
    "scaling",
    [
        {"kind": "linear", "factor": 2.0},
        {"kind": "dynamic_ntk", "factor": 2.0},
        {"kind": "yarn", "factor": 4.0, "original_max_seq_len": 8, "beta_fast": 16.0},
    ],
    ids=lambda s: s["kind"],
)
def test_rope_scaling_exports_into_rope_parameters(tmp_path: Path, scaling: dict):
    rope = {"kind": "rope", "rope_theta": 500.0, "scaling": scaling}
    run, model = _lmlab_run(tmp_path, **{**FAMILIES["llama"], "position": rope})
    res = export_model(run, tmp_path / "hf")
    params = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    hf_type = {"linear": "linear", "dynamic_ntk": "dynamic", "yarn": "yarn"}[scaling["kind"]]
    assert params["rope_type"] == hf_type and params["factor"] == scaling["factor"]
    assert res.max_abs_diff is not None
    _assert_hf_equals(tmp_path / "hf", model, "LlamaForCausalLM", t=32)


def test_a_bpe_tokenizer_exports_its_end_token(tmp_path: Path):
    """A byte-level BPE run: AutoTokenizer knows <|endoftext|>, config.json and
    generation_config.json name its id, and text round-trips through the HF tokenizer."""
    from lmlab.config import TokenizerConfig
    from lmlab.data.tokenizer import BPETokenizer

    text = "To be, or not to be, that is the question. 生きるべきか 🙂\n" * 20
    tok = BPETokenizer.train(text, TokenizerConfig(kind="bpe", vocab_size=300))
    torch.manual_seed(0)
    model = build_model(tiny_model_config(tok.vocab_size)).eval()
    run = write_run(model, tok, tmp_path / "run")
    res = export_model(run, tmp_path / "hf")
    assert "tokenizes like lmlab" in res.verify_note
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tok.eos_id
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tok.eos_id
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_id
    sample = "not to be 生きる 🙂"
    ids = hf_tok.encode(sample, add_special_tokens=False)
    assert ids == tok.encode(sample) and hf_tok.decode(ids) == sample


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_get_the_umask_permissions(tmp_path: Path, umask: int):
    """Every exported file has the mode an ordinary new file gets (0644 under umask 022), not
    safetensors' 0600, so an exported folder can be shared like any other."""
    import os

    run, _ = _lmlab_run(tmp_path, **FAMILIES["llama"])
    old = os.umask(umask)
    try:
        export_model(run, tmp_path / "hf", verify=False)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes
