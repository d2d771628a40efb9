"""Hostile folders for ``lmlab.load``: what a damaged Hugging Face or GGUF model gives.

Each folder is a tiny random transformers model written with ``save_pretrained`` (nothing
downloaded, HF_HUB_OFFLINE=1), then one file edited: a NaN/inf weight, a distinct ``lm_head``
under ``tie_word_embeddings: true``, conflicting or incomplete RoPE settings. lmlab either loads
exactly what transformers computes (logits to 1e-5) or refuses with one ``error:`` line naming
the file and the field or tensor (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from lmlab import load  # noqa: E402
from lmlab.errors import LmlabError  # noqa: E402
from tests.helpers import assert_one_error, redraw, run_cli, write_hf_folder  # noqa: E402
from tests.helpers.hf_models import hf_config  # noqa: E402
from tests.unit.test_hf_deepseek_v3 import hf_model as deepseek_model  # noqa: E402


def llama_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return redraw(transformers.LlamaForCausalLM(hf_config("llama", **overrides)))


def edit_weights(folder: Path, **changes: torch.Tensor) -> None:
    """Rewrite ``folder/model.safetensors`` with ``changes`` (tensor name -> new value)."""
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    sd.update(changes)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_hf_folder_with_non_finite_weight_is_refused(tmp_path, capsys, family, bad):
    model = llama_model() if family == "llama" else deepseek_model()
    folder = write_hf_folder(tmp_path / family, model)
    name = "model.layers.0.self_attn.o_proj.weight"
    w = load_file(str(folder / "model.safetensors"))[name].clone()
    w[0, 1] = bad
    edit_weights(folder, **{name: w})
    with pytest.raises(LmlabError, match=f"non-finite values in {name}"):
        load(folder)
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, str(folder / "model.safetensors"), "non-finite", name)


def test_gguf_with_non_finite_weight_is_refused(tmp_path, capsys):
    pytest.importorskip("gguf")
    from tests.helpers.gguf_files import tiny_llama_hf, write_llama_gguf

    model = tiny_llama_hf()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    path = write_llama_gguf(tmp_path / "bad.gguf", model)
    code, _, err = run_cli(capsys, "generate", path, "--prompt", "ab")
    assert_one_error(code, err, str(path), "non-finite values in blk.0.ffn_down.weight")


def untied_under_tie_flag(tmp_path: Path, model: torch.nn.Module) -> Path:
    """``model`` (untied, its head redrawn) saved, then config.json set to
    ``tie_word_embeddings: true``: both tensors stay in the file."""
    folder = write_hf_folder(tmp_path / "m", model)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    sd = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    return folder


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_distinct_lm_head_under_tie_flag_is_kept_as_transformers_does(tmp_path, family):
    model = (
        llama_model(tie_word_embeddings=False)
        if family == "llama"
        else deepseek_model(tie_word_embeddings=False)
    )
    folder = untied_under_tie_flag(tmp_path, model)
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.DeepseekV3ForCausalLM
    ref = cls.from_pretrained(str(folder)).eval()
    assert ref.config.tie_word_embeddings
    assert ref.lm_head.weight.data_ptr() != ref.model.embed_tokens.weight.data_ptr()
    ours, _ = load(folder)
    assert not ours.cfg.tie_embeddings
    x = torch.randint(0, ref.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, atol=1e-5, rtol=0)


def test_head_equal_to_embedding_stays_tied(tmp_path):
    model = llama_model(tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    folder = write_hf_folder(tmp_path / "m", model)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    ours, _ = load(folder)
    assert ours.cfg.tie_embeddings


def test_distinct_gpt2_head_under_tie_flag_is_kept_as_transformers_does(tmp_path):
    """GPT-2 as Llama: a stored lm_head.weight that differs from wte under
    ``tie_word_embeddings: true`` is kept (transformers: "we will NOT tie them"), logits equal."""
    torch.manual_seed(0)
    model = redraw(transformers.GPT2LMHeadModel(hf_config("gpt2")))
    folder = write_hf_folder(tmp_path / "g", model)
    edit_weights(folder, **{"lm_head.weight": torch.randn_like(model.lm_head.weight)})
    ref = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    assert ref.lm_head.weight.data_ptr() != ref.transformer.wte.weight.data_ptr()
    ours, _ = load(folder)
    assert not ours.cfg.tie_embeddings
    x = torch.randint(0, ref.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, atol=1e-5, rtol=0)


def with_config(tmp_path: Path, model: torch.nn.Module, **fields) -> Path:
    """``model`` saved, then config.json's ``fields`` replaced (None: removed)."""
    folder = write_hf_folder(tmp_path / "c", model)
    config = json.loads((folder / "config.json").read_text())
    for k, v in fields.items():
        config.pop(k, None) if v is None else config.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_conflicting_rope_parameters_and_rope_scaling_are_refused(tmp_path, capsys, family):
    model = llama_model() if family == "llama" else deepseek_model()
    folder = with_config(
        tmp_path,
        model,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, "config.json", "rope_parameters", "rope_scaling")


YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize(
    ("rope", "missing"),
    [
        ({k: v for k, v in YARN.items() if k != "factor"}, "factor"),
        ({"rope_type": "linear", "rope_theta": 500.0}, "factor"),
        ({"rope_type": "dynamic", "rope_theta": 500.0}, "factor"),
    ],
)
def test_rope_settings_missing_a_required_key_are_refused(tmp_path, capsys, family, rope, missing):
    model = llama_model() if family == "llama" else deepseek_model()
    folder = with_config(tmp_path, model, rope_parameters=rope)
    with pytest.raises(Exception):  # noqa: B017, PT011 (transformers raises KeyError or ValueError)
        transformers.AutoConfig.from_pretrained(str(folder))
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, "config.json", f"rope_parameters.{missing} is missing")


def test_deepseek_head_dim_other_than_qk_rope_head_dim_is_refused(tmp_path, capsys):
    folder = with_config(tmp_path, deepseek_model(), head_dim=16)  # qk_rope_head_dim 8
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, "config.json", "head_dim (16)", "qk_rope_head_dim (8)")


def test_deepseek_head_dim_equal_to_qk_rope_head_dim_loads(tmp_path):
    ref = deepseek_model()
    ours, _ = load(with_config(tmp_path, ref, head_dim=8))
    x = torch.randint(0, ref.config.vocab_size, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, atol=1e-5, rtol=0)


def test_deepseek_odd_qk_rope_head_dim_without_head_dim_is_refused(tmp_path, capsys):
    folder = with_config(tmp_path, deepseek_model(), qk_rope_head_dim=7, head_dim=None)
    code, _, err = run_cli(capsys, "inspect", folder)
    assert_one_error(code, err, "config.json", "even number")


def test_deepseek_mtp_layer_tensors_are_skipped_as_transformers_does(tmp_path):
    """A DeepSeek-V3 folder with its multi-token-prediction layer stored after the last one
    (``model.layers.{n}.eh_proj`` ... , ``num_nextn_predict_layers: 1``) loads: the MTP tensors
    are skipped and the logits equal transformers' (which ignores them too); a stray key that
    is not a layer is still refused by name."""
    model = deepseek_model()
    n = model.config.num_hidden_layers
    folder = with_config(tmp_path, model, num_nextn_predict_layers=1)
    d = model.config.hidden_size
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d),
        f"model.layers.{n}.enorm.weight": torch.ones(d),
        f"model.layers.{n}.hnorm.weight": torch.ones(d),
        f"model.layers.{n}.shared_head.norm.weight": torch.ones(d),
    }
    edit_weights(folder, **mtp)
    ours, _ = load(folder)
    assert ours.cfg.n_layers == n
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, model.eval()(x).logits, atol=1e-5, rtol=0)
    edit_weights(folder, **{"model.extra.weight": torch.ones(d)})
    with pytest.raises(LmlabError, match="model.extra.weight"):
        load(folder)


def _untied_gpt2(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = redraw(transformers.GPT2LMHeadModel(hf_config("gpt2", tie_word_embeddings=False)))
    return model, write_hf_folder(tmp_path / "g", model)


def test_untied_gpt2_without_a_stored_head_is_refused_naming_it(tmp_path, capsys):
    """It loaded with the embedding as its head, silently: a model the folder does not hold
    (transformers initialises a random head and warns)."""
    model, folder = _untied_gpt2(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LmlabError, match="lacks tensor lm_head.weight"):
        load(folder)
    code, _, err = run_cli(capsys, "generate", folder, "--prompt", "ab")
    assert_one_error(code, err, str(folder), "lm_head.weight")


def test_gpt2_with_tie_word_embeddings_null_is_gpt2s_default(tmp_path):
    """null read as false made any GPT-2 untied; it is the default (tied), and a distinct stored
    head unties it as under true."""
    model, folder = _untied_gpt2(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = None
    (folder / "config.json").write_text(json.dumps(config))
    ours, _ = load(folder)
    assert not ours.cfg.tie_embeddings  # the distinct head is kept
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, model(x).logits, atol=1e-5, rtol=0)
    sd = load_file(str(folder / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tied, _ = load(folder)  # no head stored: tied, as GPT-2's default
    assert tied.cfg.tie_embeddings


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.\u00b2.eh_proj.weight",  # '²'.isdigit(): was "ValueError: invalid literal"
        "model.layers.\u0662.eh_proj.weight",  # Arabic-Indic 2: was skipped as layer 2
        "model.layers.02.eh_proj.weight",  # was skipped as layer 2
        "model.layers.7.eh_proj.weight",  # not right after the last layer (2): was skipped
        "model.layers.999999999999999999999.eh_proj.weight",  # was skipped
        "model.layers.2.mlp.eh_proj.weight",  # inside a module: was skipped (any ".eh_proj.")
        "model.layers.2.eh_proj.bias",  # a bias without the projection: was skipped
    ],
)
def test_deepseek_tensors_that_only_look_like_an_mtp_layer_are_refused_by_name(
    tmp_path, capsys, key
):
    model = deepseek_model()
    d = model.config.hidden_size
    folder = with_config(tmp_path, model, num_nextn_predict_layers=1)
    edit_weights(folder, **{key: torch.randn(d, 2 * d) if "weight" in key else torch.randn(d)})
    code, _, err = run_cli(capsys, "inspect", folder)
    assert_one_error(code, err, str(folder), repr(key), "has no place")
