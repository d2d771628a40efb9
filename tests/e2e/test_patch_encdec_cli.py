"""``lmlab patch`` on an encoder-decoder run: --clean-source / --corrupted-source with the
decoder text defaulting to the start token alone gives one JSON object with the encoder map
(layers x source positions) and the decoder maps, whose scores equal the library's on the same
ids; the PNGs and the page carry each map's own layers; the options of the wrong kind and
missing or identical corruptions are one ``error:`` line each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lmlab.analysis.patching import patch_activations
from lmlab.interop.load import load
from tests.helpers import assert_one_error, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCE, CORRUPTED = "abcd", "abca"  # one token per character


def test_patch_json_pngs_and_page_of_an_encoder_decoder(seq2seq_run: Path, tmp_path, capsys):
    page, maps = tmp_path / "p.html", tmp_path / "maps"
    code, out, err = run_cli(
        capsys, "patch", str(seq2seq_run), "--clean-source", SOURCE, "--corrupted-source",
        CORRUPTED, "--target", "b", "--versus", "a", "--what",
        "encoder.resid_pre,encoder.heads,resid_cross,cross_heads", "--out", str(maps), "--html",
        str(page), "--json", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out)
    assert r["source_tokens"] == list(SOURCE) and r["corrupted_source_tokens"] == list(CORRUPTED)
    assert r["tokens"] == r["corrupted_tokens"] == ["<pad>"]  # the start token alone
    assert r["n_source"] == 4 and r["n_tokens"] == 1
    s = r["scores"]
    assert list(s) == ["encoder.resid_pre", "encoder.heads", "resid_cross", "cross_heads"]
    assert [(len(v), len(v[0])) for v in s.values()] == [(2, 4), (2, 4), (2, 1), (2, 4)]
    # only the changed token counts (to the rounding of batched rows against one run)
    assert s["encoder.resid_pre"][0] == pytest.approx([0.0, 0.0, 0.0, 1.0], abs=1e-4)
    # the same numbers as the library on the ids the command built (the start token first)
    model, tok = load(seq2seq_run)
    start = model.cfg.seq2seq.decoder_start_token_id
    dec = torch.tensor([[start]])
    want = patch_activations(
        model, dec, dec, tok.encode("b")[0], tok.encode("a")[0], what=list(s),
        clean_source=torch.tensor([tok.encode_for_model(SOURCE)]),
        corrupted_source=torch.tensor([tok.encode_for_model(CORRUPTED)]),
    )  # fmt: skip
    assert {w: v.tolist() for w, v in want.scores.items()} == s
    names = ["patch-cross_heads.png", "patch-encoder_heads.png", "patch-encoder_resid_pre.png",
             "patch-resid_cross.png"]  # fmt: skip
    assert sorted(p.name for p in maps.iterdir()) == names
    m = re.search(r'id="lmlab-data">(.*?)</script>', page.read_text(encoding="utf-8"), re.S)
    assert m is not None
    (panel,) = json.loads(m.group(1))["panels"]
    got = {x["what"]: (x["layers"], x["corrupted"], x["heads"]) for x in panel["data"]["maps"]}
    assert got["encoder.resid_pre"] == ([0, 1], list(CORRUPTED), False)
    assert got["cross_heads"] == ([0, 1], ["<pad>"], True)
    assert "patching: 26/26 runs" in err  # 2 x 4 + 2 x 4 + 2 x 1 + 2 x 4


def test_the_text_report_lists_source_and_decoder_patches(seq2seq_run: Path, capsys):
    code, out, _ = run_cli(
        capsys, "patch", str(seq2seq_run), "--clean-source", SOURCE, "--corrupted-source",
        CORRUPTED, "--clean", "dc", "--target", "b", "--no-plot", "--top", "2", "--device", "cpu",
    )  # fmt: skip
    assert code == 0
    assert "clean source, 4 tokens: a b c d" in out and "corrupted source: a b c a" in out
    assert "clean decoder input, 3 tokens: <pad> d c" in out
    assert "(nats) at the last decoder token" in out
    assert re.search(r"^encoder\.resid_pre +0 pos 3 d +1\.000", out, re.M)


@pytest.mark.parametrize(
    "run, args, needles",
    [
        ("s2s", ["--clean", "ab", "--corrupted", "ba"], ["covers decoder", "--clean-source"]),
        ("s2s", ["--corrupted-source", "abca"], ["--corrupted-source needs --clean-source"]),
        ("s2s", ["--clean-source", "abcd"], ["corrupted run is the clean one"]),
        ("s2s", ["--clean-source", "abcd", "--corrupted-source", "abc"],
         ["clean source is 4 tokens and the corrupted one 3", "same token length"]),
        ("s2s", ["--clean-source", "abcd", "--corrupted-source", "abca", "--what", "mlp"],
         ["--what mlp", "an encoder-decoder's", "encoder.resid_pre", "cross_heads"]),
        ("s2s", ["--clean-source", "", "--corrupted-source", "abca"], ["--clean-source is empty"]),
        ("s2s", ["--clean-source", "a" * 20, "--corrupted-source", "b" * 20],
         ["--clean-source is 20 tokens", "context of 16"]),
        ("decoder", ["--clean-source", "ROMEO", "--corrupted-source", "JULIE", "--clean", "a"],
         ["an encoder-decoder's source texts", "model.kind=decoder"]),
        ("decoder", ["--corrupted", "ROMEO"], ["--clean is required"]),
    ],
    ids=["no-source", "only-corrupted-source", "nothing-corrupted", "lengths", "what",
         "empty-source", "too-long", "decoder-with-source", "decoder-without-clean"],
)  # fmt: skip
def test_refusals_are_one_line(seq2seq_run, tiny_run, capsys, run, args, needles):
    path = seq2seq_run if run == "s2s" else tiny_run
    code, _, err = run_cli(capsys, "patch", str(path), *args, "--target", "b", "--no-plot",
                           "--device", "cpu")  # fmt: skip
    assert_one_error(code, err, *needles)
