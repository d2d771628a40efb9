"""Bad input to lmlab export / import / train --init-from: one clear error line (exit 2) naming
the thing at fault, and nothing half-written in --out (no temporary sibling left either)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmlab.cli import main
from lmlab.data.tokenizer import CharTokenizer
from lmlab.interop.families import NotRepresentable, match_family
from lmlab.interop.importer import write_run
from lmlab.models import build_model
from tests.helpers import tiny_model_config

VOCAB = 40
CHARS = [chr(0x30 + i) for i in range(VOCAB)]
LLAMA = {
    "norm": {"kind": "rmsnorm"},
    "ffn": {"kind": "swiglu", "bias": False},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
}


def _error(capsys, argv: list[str]) -> str:
    """Run the CLI; require exit code 2 and exactly one ``error: ...`` line; return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _run(tmp_path: Path, **model) -> Path:
    torch.manual_seed(0)
    return write_run(
        build_model(tiny_model_config(VOCAB, **model)), CharTokenizer(CHARS), tmp_path / "run"
    )


def _hf_llama(tmp_path: Path) -> Path:
    """A tiny Llama folder (config.json + model.safetensors + tokenizer.json) from an lmlab
    export, written without transformers."""
    run = _run(tmp_path, **LLAMA)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ({**LLAMA, "position": {"kind": "alibi"}}, "model.position.kind=alibi"),
        ({**LLAMA, "attention": {"n_heads": 4, "kind": "linear"}}, "model.attention.kind=linear"),
        ({**LLAMA, "block": {"kind": "post"}}, "model.block.kind=post"),
        ({"position": {"kind": "rope", "interleaved": True}}, "model.position.interleaved"),
    ],
    ids=["alibi-llama", "linear-attention", "post-norm-rmsnorm", "interleaved-rope"],
)
def test_export_refuses_a_model_with_no_hf_counterpart(tmp_path, capsys, model, named):
    run = _run(tmp_path, **model)
    out = tmp_path / "hf"
    msg = _error(capsys, ["export", str(run), "--out", str(out)])
    assert "no Hugging Face counterpart" in msg and named in msg
    _nothing_written(out)


def test_the_refusal_names_the_closest_family_and_only_its_gaps():
    with pytest.raises(NotRepresentable) as e:
        match_family(tiny_model_config(VOCAB, **LLAMA, position={"kind": "alibi"}))
    assert e.value.family == "Llama" and e.value.missing == ["model.position.kind=alibi"]
    with pytest.raises(NotRepresentable) as e:  # the Mini-GPT with ALiBi: GPT-NeoX's shape
        match_family(tiny_model_config(VOCAB, position={"kind": "alibi"}))
    assert e.value.family == "GPT-NeoX" and e.value.missing == ["model.position.kind=alibi"]


def test_unknown_architecture_is_named_with_the_supported_ones(tmp_path, capsys):
    folder = _hf_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    out = tmp_path / "imported"
    msg = _error(capsys, ["import", str(folder), "--out", str(out)])
    assert "'falcon'" in msg and "llama" in msg and "gpt_neox" in msg
    _nothing_written(out)


def test_a_missing_tensor_is_named(tmp_path, capsys):
    folder = _hf_llama(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    out = tmp_path / "imported"
    msg = _error(capsys, ["import", str(folder), "--out", str(out)])
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "lacks" in msg
    _nothing_written(out)


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, capsys):
    folder = _hf_llama(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 32)
    save_file(tensors, str(folder / "model.safetensors"))
    out = tmp_path / "imported"
    msg = _error(capsys, ["import", str(folder), "--out", str(out)])
    want = tiny_model_config(VOCAB, **LLAMA).d_ff
    assert "model.layers.0.mlp.up_proj.weight" in msg
    assert "(7, 32)" in msg and f"({want}, 32)" in msg
    _nothing_written(out)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"just some text, not weights\n", "neither a model folder, a safetensors file nor a GGUF"),
        (None, "bare safetensors file"),
    ],
    ids=["text-file", "bare-safetensors"],
)
def test_a_file_that_is_not_a_model_is_refused(tmp_path, capsys, content, named):
    path = tmp_path / "model.bin"
    if content is None:
        save_file({"w": torch.zeros(2)}, str(path))
    else:
        path.write_bytes(content)
    for argv in (["import", str(path)], ["export", str(path)]):
        out = tmp_path / "out"
        msg = _error(capsys, [*argv, "--out", str(out)])
        assert str(path) in msg and named in msg
        _nothing_written(out)


def test_out_that_is_a_file_or_not_empty(tmp_path, capsys):
    run = _run(tmp_path, **LLAMA)
    file_out = tmp_path / "taken.txt"
    file_out.write_text("keep me")
    for cmd in ("export", "import"):
        msg = _error(capsys, [cmd, str(run), "--out", str(file_out)])
        assert f"--out {file_out} is a file" in msg
    assert file_out.read_text() == "keep me"
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("old")
    msg = _error(capsys, ["export", str(run), "--out", str(full)])
    assert "not empty" in msg and "--force" in msg
    assert sorted(p.name for p in full.iterdir()) == ["old.txt"]
    assert main(["export", str(run), "--out", str(full), "--force"]) == 0
    assert (full / "model.safetensors").is_file() and not (full / "old.txt").exists()


def test_a_failed_export_check_leaves_nothing(tmp_path, capsys, monkeypatch):
    import lmlab.interop.export as export

    def broken(folder, model, tokenizer):
        assert (folder / "model.safetensors").is_file()  # written, not yet in place
        raise export.LmlabError("logits differ (simulated)")

    monkeypatch.setattr(export, "verify_hf_folder", broken)
    run = _run(tmp_path, **LLAMA)
    out = tmp_path / "hf"
    assert "simulated" in _error(capsys, ["export", str(run), "--out", str(out)])
    _nothing_written(out)


def test_init_from_refuses_resume_and_model_overrides(tmp_path, capsys):
    run = _run(tmp_path, **LLAMA)
    for extra in (["--resume", str(run)], ["--set", "model.d_model=64"]):
        msg = _error(capsys, ["train", "--init-from", str(run), *extra])
        assert "--init-from" in msg
    not_a_model = tmp_path / "nothing"
    msg = _error(capsys, ["train", "--init-from", str(not_a_model), "--out", str(tmp_path / "r")])
    assert f"not found: {not_a_model}" in msg


@pytest.mark.parametrize(
    ("fmt", "inside"),
    [
        ("gguf", "config.yaml"),
        ("gguf", "checkpoints/latest"),
        ("hf", "checkpoints"),
        ("hf", "data"),
    ],
)
def test_force_never_replaces_part_of_the_model_being_read(tmp_path, capsys, fmt, inside):
    """`export RUN --format gguf --out RUN/config.yaml --force` replaced the run's config.yaml
    with the GGUF file (and --format hf --out RUN/checkpoints its checkpoints): the run was lost."""
    from tests.helpers import assert_unchanged, snapshot

    run = _run(tmp_path, **LLAMA)
    (run / "data").mkdir(exist_ok=True)
    (run / "data" / "keep.txt").write_text("x")
    before = snapshot(run)
    argv = ["export", str(run), "--format", fmt, "--out", str(run / inside), "--force"]
    assert "is inside the model it reads" in _error(capsys, argv)
    assert_unchanged(run, before)
    assert snapshot(run) == before


def test_a_new_name_inside_the_run_folder_is_still_allowed(tmp_path, capsys):
    run = _run(tmp_path, **LLAMA)
    assert main(["export", str(run), "--format", "gguf", "--out", str(run / "model.gguf")]) == 0
    assert (run / "model.gguf").read_bytes()[:4] == b"GGUF"
