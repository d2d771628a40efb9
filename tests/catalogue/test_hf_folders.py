"""Hugging Face model folders: config.json, the shard index, weights, tokenizer and
sentence-transformers files. Each bad one gives one error line naming the file and the field or
tensor, before any tensor is allocated; no path leads outside the folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lmlab.errors import LmlabError
from lmlab.interop.families import hf_config_json, match_family
from lmlab.interop.load import load
from lmlab.models import build_model
from lmlab.training import memory
from tests.helpers import assert_one_error, run_cli, tiny_model_config, within

LLAMA = {
    "norm": {"kind": "rmsnorm"},
    "ffn": {"kind": "swiglu", "bias": False},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
    "position": {"kind": "rope"},
}


def _llama_folder(folder: Path, **config: Any) -> Path:
    """A tiny Llama folder (config.json + model.safetensors), ``config`` overriding config.json."""
    cfg = tiny_model_config(40, **LLAMA)
    model = build_model(cfg)
    family, kwargs = match_family(cfg)
    folder.mkdir(parents=True)
    raw = {**hf_config_json(family, kwargs), **config}
    (folder / "config.json").write_text(json.dumps(raw))
    assert family.from_state is not None
    save_file(family.from_state(model.state_dict(), cfg), folder / "model.safetensors")
    return folder


def _load(capsys, folder: Path) -> tuple[int, str, str]:
    with within(30):
        return run_cli(capsys, "generate", folder, "--prompt", "a", "--max-new-tokens", "1")


def test_a_tiny_llama_folder_loads(tmp_path):
    model, tokenizer = load(_llama_folder(tmp_path / "hf"))
    assert model.cfg.n_layers == 2 and tokenizer is None


# ------------------------------------------------------------------ paths outside the folder


def _sharded(tmp_path: Path, shard_name: str) -> Path:
    """A folder whose index names ``shard_name`` for every tensor; the real weights are moved
    next to the folder (outside it), where ``../outside.safetensors`` would find them."""
    folder = _llama_folder(tmp_path / "hf")
    (folder / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": shard_name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_a_shard_index_naming_a_path_outside_the_folder_is_refused(tmp_path, capsys, kind):
    outside = tmp_path / "outside.safetensors"
    name = "../outside.safetensors" if kind == "dotdot" else str(outside)
    folder = _sharded(tmp_path, name)  # was: loaded the file outside the folder
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "model.safetensors.index.json weight_map", "not a path inside")


def test_a_shard_that_is_a_symlink_out_of_the_folder_is_refused(tmp_path, capsys):
    folder = _sharded(tmp_path, "shard-1.safetensors")
    (folder / "shard-1.safetensors").symlink_to(tmp_path / "outside.safetensors")
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "shard-1.safetensors", "outside")


def test_weights_that_are_a_symlink_out_of_the_folder_are_refused(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "model.safetensors is a symlink leading outside")


def test_a_tokenizer_that_is_a_symlink_out_of_the_folder_is_refused(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    (tmp_path / "tokenizer.json").write_text("{}")
    (folder / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "tokenizer.json is a symlink leading outside")


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = _llama_folder(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    (snapshot / "model.safetensors").rename(repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")
    model, _ = load(snapshot)
    assert model.cfg.n_layers == 2


@pytest.mark.parametrize(
    ("modules", "needle"),
    [
        ([{"type": "sentence_transformers.models.Pooling", "path": "../../x"}], "not a path"),
        ([{"type": "sentence_transformers.models.Pooling", "path": "/etc"}], "not a path"),
        ([{"type": "sentence_transformers.models.Pooling", "path": 5}], "path is 5"),
        ({"not": "a list"}, "must hold a list"),
    ],
    ids=["dotdot", "absolute", "not-a-string", "not-a-list"],
)
def test_sentence_transformers_module_paths_stay_inside_the_folder(tmp_path, modules, needle):
    from lmlab.encoding.embed import read_pooling

    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    folder = tmp_path / "a" / "st"
    folder.mkdir(parents=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LmlabError, match=needle):  # was: read ../../x/config.json (max pooling)
        read_pooling(folder)


# ------------------------------------------------------------------ config.json fields

BAD_FIELDS = {
    # was a model of 10**12 channels built (RuntimeError or the machine out of memory)
    "hidden-1e12": ({"hidden_size": 10**12}, "hidden_size"),
    # was 10**9 layers built one after another (a hang)
    "layers-1e9": ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    "vocab-negative": ({"vocab_size": -1}, "vocab_size"),
    "zero-heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "heads-do-not-divide": (
        {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
        "divisible",
    ),
    "kv-heads-do-not-divide": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "intermediate-string": ({"intermediate_size": "abc"}, "intermediate_size"),
    "layers-float": ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    "layers-bool": ({"num_hidden_layers": True}, "num_hidden_layers"),
    "context-null": ({"max_position_embeddings": None}, "max_position_embeddings"),
    # was silently the default 10000
    "rope-theta-null": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
        "rope_theta",
    ),
    "rope-not-an-object": ({"rope_parameters": "fast"}, "rope_parameters"),
    "eps-zero": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    # was silently true
    "tie-as-string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "model-type-list": ({"model_type": ["llama"]}, "model_type"),
}


@pytest.mark.parametrize(("fields", "needle"), BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_a_bad_config_field_is_one_error_naming_the_file_and_field(
    tmp_path, capsys, fields, needle
):
    folder = _llama_folder(tmp_path / "hf", **fields)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "config.json", needle)


# ------------------------------------------------------------------ index and weights


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ("not json", "not valid JSON"),
        ('{"weight_map": []}', "weight_map must be"),
        ('{"weight_map": {"model.embed_tokens.weight": 5}}', "not a file name"),
    ],
    ids=["not-json", "weight-map-a-list", "file-name-a-number"],
)
def test_a_malformed_shard_index_is_one_error(tmp_path, capsys, index, needle):
    folder = _llama_folder(tmp_path / "hf")
    (folder / "model.safetensors.index.json").write_text(index)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "model.safetensors.index.json", needle)


def _rewrite_weights(folder: Path, change) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    change(sd)
    save_file(sd, folder / "model.safetensors")


def test_a_weight_stored_as_integers_is_refused_naming_it(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    key = "model.layers.0.mlp.up_proj.weight"

    def to_int(sd):
        sd[key] = sd[key].to(torch.int64)  # was: silently cast to float

    _rewrite_weights(folder, to_int)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "layers.0.ffn.up_proj.weight", "torch.int64", "floating point")


def test_a_wrongly_shaped_weight_names_the_tensor_and_both_shapes(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    key = "model.layers.1.self_attn.o_proj.weight"

    def reshape(sd):
        sd[key] = torch.zeros(sd[key].shape[0], sd[key].shape[1] + 1)

    _rewrite_weights(folder, reshape)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, key, "(32, 33)", "(32, 32)")


def test_a_missing_weight_is_named(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    _rewrite_weights(folder, lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"))
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "lacks tensor model.layers.1.mlp.down_proj.weight")


def test_a_weight_the_config_has_no_place_for_is_named(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "hf")
    extra = "model.layers.7.mlp.up_proj.weight"  # a layer the config does not have

    def add(sd):
        sd[extra] = torch.zeros(2, 2)

    _rewrite_weights(folder, add)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "layers.7.ffn.up_proj.weight")


@pytest.mark.parametrize(
    "header",
    [struct.pack("<Q", 1 << 62) + b"{}", struct.pack("<Q", 9) + b"not json!"],
    ids=["huge-header-length", "header-not-json"],
)
def test_a_broken_safetensors_header_is_one_error_naming_the_file(tmp_path, capsys, header):
    folder = _llama_folder(tmp_path / "hf")
    (folder / "model.safetensors").write_bytes(header)
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "model.safetensors is corrupt")


# ------------------------------------------------------------------ memory


def fake_cgroup_v2(monkeypatch, tmp_path: Path, limit: int, current: int = 0) -> None:
    """Point the memory check at a cgroup v2 hierarchy whose memory.max is ``limit`` bytes."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)


def test_loading_checks_the_estimate_against_the_cgroup_memory_limit(tmp_path, capsys, monkeypatch):
    folder = _llama_folder(tmp_path / "hf")
    fake_cgroup_v2(monkeypatch, tmp_path, limit=64 * 1024)  # a 64 KiB container
    code, _, err = _load(capsys, folder)  # was: loaded without looking at the limit
    assert_one_error(code, err, "needs about", "to load", "cgroup memory limit", "memory.max")


def test_a_shard_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    import os

    folder = _sharded(tmp_path, "shard-1.safetensors")
    os.mkfifo(folder / "shard-1.safetensors")  # was: open() waited for a writer forever
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, "shard-1.safetensors", "FIFO")


@pytest.mark.parametrize(
    ("tokenizer_config", "cause"),
    [({"chat_template": 7}, "chat_template must be a string"), ({"eos_token": 5}, "eos_token")],
    ids=["template-a-number", "eos-a-number"],
)
def test_a_refused_tokenizer_is_not_called_missing(
    tmp_path, capsys, tiny_run, tokenizer_config, cause
):
    """A tokenizer.json beside a bad tokenizer_config.json: the model loads without it (a
    warning naming the file and field) and generate's error says the tokenizer was refused (was:
    'has no tokenizer', beside a tokenizer.json)."""
    folder = _llama_folder(tmp_path / "hf")
    (folder / "tokenizer.json").write_bytes((tiny_run / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    code, _, err = _load(capsys, folder)
    assert_one_error(code, err, str(folder), "tokenizer was refused")
    assert f"warning: {folder / 'tokenizer_config.json'}: {cause}" in err
