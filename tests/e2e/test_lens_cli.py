"""``lmlab lens`` on the tiny trained run: --json is one JSON object on stdout whose last lens
row is the model's own prediction and whose attribution sums to the real logit; the PNGs and
the page are written; a bad --target, --position or an existing --html is one error line
before anything is written. An encoder-decoder run with --source: the lens of its decoder
behind the start token, its attribution with self and cross heads, the refusals of a missing
or misplaced --source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lmlab.analysis.attention_maps import token_label
from lmlab.interop.load import load
from tests.helpers import assert_one_error, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "ROMEO: But"


def lens(capsys, run: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(capsys, "lens", str(run), "--text", TEXT, "--device", "cpu", *extra)


def test_lens_json_is_one_object_matching_the_model(tiny_run: Path, tmp_path: Path, capsys):
    code, out, err = lens(
        capsys, tiny_run, "--target", "O", "--versus", "E", "--position", "3", "--top", "3",
        "--json", "--out", str(tmp_path / "pngs"),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)  # the whole of stdout
    assert report["tokens"] == ["R", "O", "M", "E", "O", ":", "␣", "B", "u", "t"]
    assert report["rows"] == ["embed", "layer 0", "layer 1"]
    model, tok = load(tiny_run)
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        logits = model(ids).logits[0]
    probs = torch.softmax(logits, -1)
    last = report["top"][-1]  # (T, k) [label, prob] of the last row: the model's output
    assert [ids[0] for ids in report["top_ids"][-1]] == logits.argmax(-1).tolist()
    assert [cell[0][0] for cell in last] == [
        token_label(tok.token_bytes(i)) for i in logits.argmax(-1).tolist()
    ]
    assert [c[0][1] for c in last] == pytest.approx(probs.max(-1).values.tolist(), abs=1e-6)
    assert all(len(cell) == 3 for row in report["top"] for cell in row)
    o, e = tok.encode("O")[0], tok.encode("E")[0]
    assert report["target"]["id"] == o
    assert report["target"]["probs"][-1] == pytest.approx(probs[:, o].tolist(), abs=1e-6)
    dla = report["dla"]
    want = float(logits[3, o] - logits[3, e])
    assert dla["actual"] == pytest.approx(want, abs=1e-5)
    assert abs(sum(dla["components"].values()) - want) < 1e-4
    assert dla["position"] == 3 and len(dla["top"]) == 10
    assert sorted(Path(f).name for f in report["files"]) == ["dla.png", "lens.png"]
    for f in report["files"]:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lens_prints_the_tables_and_writes_a_page(tiny_run: Path, tmp_path: Path, capsys):
    page = tmp_path / "lens.html"
    code, out, _ = lens(capsys, tiny_run, "--target", "O", "--no-plot", "--html", str(page))
    assert code == 0
    assert "logit lens: top-1 prediction of the next token" in out
    assert "target 'O': probability (rank)" in out
    assert re.search(r"sum of all \d+ +[+-]\d+\.\d{4}\n +actual +[+-]\d+\.\d{4}", out)
    assert out.strip().splitlines()[-1] == f"wrote {page}"
    blob = re.search(r'id="lmlab-data">(.*?)</script>', page.read_text(encoding="utf-8"), re.S)
    assert blob is not None
    panels = json.loads(blob.group(1))["panels"]
    assert [p["kind"] for p in panels] == ["lens", "dla"]
    assert panels[0]["data"]["probs"]["shape"] == [3, 10, 5]


def test_an_existing_html_page_is_refused_before_the_model_runs(tiny_run, tmp_path, capsys):
    page = tmp_path / "mine.html"
    page.write_text("mine")
    code, _, err = lens(capsys, tiny_run, "--out", str(tmp_path / "pngs"), "--html", str(page))
    assert_one_error(code, err, "--html", "already exists")
    assert page.read_text() == "mine" and not (tmp_path / "pngs").exists()
    beside = tmp_path / "lens.png"  # the name of a PNG --out receives
    code, _, err = lens(capsys, tiny_run, "--out", str(tmp_path), "--html", str(beside))
    assert_one_error(code, err, "--html", "the name of a PNG", "file name of its own")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.html"]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (("--target", "ROM"), ("--target 'ROM' is 3 tokens",)),
        (("--target", "中"), ("--target '中' is not in the vocabulary",)),
        (("--target", ""), ("--target is empty",)),
        (("--target", "O", "--versus", "OM"), ("--versus 'OM' is 2 tokens",)),
        (("--versus", "O"), ("--versus goes with --target",)),
        (("--target", "O", "--versus", "O"), ("--versus 'O' is the --target token",)),
        (("--target", "O", "--position", "10"), ("--position 10 is out of range", "10 tokens")),
        (("--position", "-11"), ("--position -11 is out of range",)),
        (("--top", "0"), ("--top must be between 1 and 1000",)),
        (("--target", "\udcff"), ("--target is not UTF-8 text",)),
    ],
)
def test_bad_arguments_are_one_error_line(tiny_run, tmp_path, capsys, extra, needles):
    code, out, err = lens(capsys, tiny_run, "--out", str(tmp_path / "pngs"), *extra)
    assert_one_error(code, err, *needles)
    assert out == "" and not (tmp_path / "pngs").exists()


def test_an_encoders_lens_runs_and_its_attribution_is_refused_with_the_reason(
    encoder_run: Path, capsys
):
    code, out, err = run_cli(
        capsys, "lens", str(encoder_run), "--text", "speak, speak.", "--target", ",",
        "--no-plot", "--json", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["tokens"][0] == "[CLS]" and report["tokens"][-1] == "[SEP]"
    assert report["dla"] is None and "not linear" in report["dla_unavailable"]
    assert err.startswith("note: direct logit attribution needs a decoder")


def test_lens_cli_on_an_encoder_decoder_run(seq2seq_run: Path, tmp_path: Path, capsys):
    code, out, err = run_cli(
        capsys, "lens", str(seq2seq_run), "--source", "abcd", "--text", "dc", "--target", "b",
        "--json", "--device", "cpu", "--out", str(tmp_path / "pngs"),
        "--html", str(tmp_path / "lens.html"),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    model, tok = load(seq2seq_run)
    start = model.cfg.seq2seq.decoder_start_token_id
    src = tok.encode_for_model("abcd")
    dec = [start, *tok.encode("dc")]
    assert report["source"]["ids"] == src and report["ids"] == dec
    assert report["hooks"][0] == "decoder.layers.0.hook_resid_pre"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]))
    logits = logits.logits[0]
    assert [row[0] for row in report["top_ids"][-1]] == logits.argmax(-1).tolist()
    dla, b = report["dla"], tok.encode("b")[0]
    assert dla["actual"] == pytest.approx(float(logits[-1, b]), abs=1e-5)
    assert abs(sum(dla["components"].values()) - dla["actual"]) < 1e-4
    assert "L0.cross.H0" in dla["components"] and "L0.self.H0" in dla["components"]
    assert sorted(Path(f).name for f in report["files"]) == ["dla.png", "lens.html", "lens.png"]
    page = (tmp_path / "lens.html").read_text(encoding="utf-8")
    assert "cross H0" in page and report["source"]["tokens"][0] in page
    code, text_out, _ = run_cli(capsys, "lens", str(seq2seq_run), "--source", "abcd", "--text",
                                "dc", "--target", "b", "--no-plot", "--device", "cpu")  # fmt: skip
    assert code == 0 and text_out.startswith("source, ") and "L" in text_out
    code, out, err = run_cli(capsys, "lens", str(seq2seq_run), "--source", "abcd", "--text", "",
                             "--json", "--no-plot", "--device", "cpu")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["ids"] == [start]  # the start token alone: the first prediction


def test_lens_cli_source_refusals_are_one_error_line(seq2seq_run, tiny_run, capsys):
    code, out, err = run_cli(capsys, "lens", str(seq2seq_run), "--text", "abc", "--no-plot",
                             "--device", "cpu")  # fmt: skip
    assert_one_error(code, err, "model.kind=encoder_decoder", "--source")
    code, out, err = run_cli(capsys, "lens", str(tiny_run), "--text", "abc", "--source", "x",
                             "--no-plot", "--device", "cpu")  # fmt: skip
    assert_one_error(code, err, "--source goes with an encoder-decoder", "model.kind=decoder")
    code, out, err = run_cli(capsys, "lens", str(seq2seq_run), "--text", "abc", "--source",
                             "a" * 40, "--no-plot", "--device", "cpu")  # fmt: skip
    assert_one_error(code, err, "--source is", "encoder context")
    assert out == ""


def test_lens_text_output_says_1_token_not_1_tokens(tiny_run: Path, tmp_path: Path, capsys):
    code, out, err = run_cli(
        capsys, "lens", str(tiny_run), "--text", "R", "--device", "cpu", "--out", str(tmp_path)
    )
    assert code == 0, err
    assert "1 token: R" in out and "1 tokens" not in out
    code, out, err = lens(capsys, tiny_run, "--out", str(tmp_path / "more"))
    assert code == 0, err
    assert "10 tokens: R O M E O" in out
