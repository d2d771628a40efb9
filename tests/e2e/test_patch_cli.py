"""``lmlab patch``: one JSON object on stdout (progress on stderr), a PNG per map and the
page, and one ``error:`` line for prompts of unequal length, a multi-token --target, equal
clean and corrupted metrics, a bad --what and an existing --html (refused before any work)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import assert_one_error, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
CLEAN, CORRUPTED = "ROMEO: But soft", "HAMLE: But soft"  # 15 characters each


def blob(path: Path) -> dict:
    m = re.search(r'id="lmlab-data">(.*?)</script>', path.read_text(encoding="utf-8"), re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_patch_json_pngs_and_page(tiny_run: Path, tmp_path: Path, capsys):
    page, maps = tmp_path / "p.html", tmp_path / "maps"
    code, out, err = run_cli(
        capsys, "patch", str(tiny_run), "--clean", CLEAN, "--corrupted", CORRUPTED,
        "--target", ",", "--versus", " ", "--what", "resid_pre,heads", "--out", str(maps),
        "--html", str(page), "--json", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out)  # the whole of stdout is one JSON object
    assert r["tokens"] == list(CLEAN.replace(" ", "␣")) and r["metric"] == "logit_diff"
    assert r["target_token"] == "," and r["versus_token"] == "␣"
    assert list(r["scores"]) == ["resid_pre", "heads"] and len(r["scores"]["heads"]) == 2
    assert len(r["scores"]["resid_pre"][0]) == 15 and len(r["scores"]["heads"][0]) == 4
    span = r["metric_clean"] - r["metric_corrupt"]
    assert [len(r["top"][w]) for w in ("resid_pre", "heads")] == [5, 5]  # the default --top
    for c in r["top"]["resid_pre"] + r["top"]["heads"]:  # each score: its metric, normalised
        assert c["score"] == pytest.approx((c["patched"] - r["metric_corrupt"]) / span)
    # layer 0's residual after the changed tokens is the corrupted one: no effect
    assert r["scores"]["resid_pre"][0][5:] == [0.0] * 10
    names = ["patch-heads.png", "patch-resid_pre.png"]
    assert sorted(p.name for p in maps.iterdir()) == names
    assert all((maps / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert r["files"][-1] == str(page)
    (panel,) = blob(page)["panels"]
    assert panel["kind"] == "patch"
    assert [m["what"] for m in panel["data"]["maps"]] == ["resid_pre", "heads"]
    assert panel["data"]["maps"][0]["columns"] == r["tokens"]
    assert "patching: 15/38 runs" in err and "patching: 38/38 runs" in err  # 2 x 15 + 2 x 4


def test_patch_text_output_and_log_prob_metric(tiny_run: Path, capsys):
    code, out, _ = run_cli(
        capsys, "patch", str(tiny_run), "--clean", "ROMEO:", "--corrupted", "HAMLE:",
        "--target", "\n", "--what", "resid_pre", "--no-plot", "--top", "3", "--device", "cpu",
    )  # fmt: skip
    assert code == 0
    assert "log p('\\\\n') (nats) at the last token: clean" in out
    rows = [line for line in out.splitlines() if line.startswith("resid_pre ")]
    assert len(rows) == 3 and "wrote" not in out


def test_a_one_token_prompt_is_one_token_not_one_tokens(tiny_run: Path, capsys):
    code, out, err = run_cli(
        capsys, "patch", str(tiny_run), "--clean", "R", "--corrupted", "H",
        "--target", "\n", "--what", "resid_pre", "--no-plot", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    assert "clean, 1 token: R" in out and "1 tokens" not in out
    code, _, err = run_cli(
        capsys, "patch", str(tiny_run), "--clean", "R", "--corrupted", "HA",
        "--target", "\n", "--no-plot", "--device", "cpu",
    )  # fmt: skip
    assert_one_error(code, err, "the clean prompt is 1 token and the corrupted one 2")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--corrupted", "JULIET: But so"], ["15 tokens", "14", "same token length"]),
        (["--target", "ab"], ["--target 'ab' is 2 tokens", "not one"]),
        (["--corrupted", CLEAN], ["on both the clean and the corrupted", "undefined"]),
        (["--what", "resid_pre,mlp"], ["--what mlp", "resid_pre, resid_mid"]),
        (["--versus", ","], ["--versus", "is the --target"]),
        (["--target", ""], ["--target '' is 0 tokens"]),
        (["--clean", ""], ["--clean is empty"]),
        (["--clean", "a" * 40, "--corrupted", "b" * 40], ["40 tokens", "context of 32"]),
    ],
    ids=[
        "lengths",
        "multi-token",
        "equal-metric",
        "what",
        "versus-is-target",
        "empty-target",
        "empty-clean",
        "too-long",
    ],  # fmt: skip
)
def test_patch_errors_are_one_line(tiny_run: Path, capsys, args, needles):
    base = {"--clean": CLEAN, "--corrupted": CORRUPTED, "--target": ","}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = [x for kv in base.items() for x in kv]
    code, _, err = run_cli(capsys, "patch", str(tiny_run), *argv, "--no-plot", "--device", "cpu")
    assert_one_error(code, err, *needles)


def test_an_existing_html_is_refused_before_the_model_is_loaded(tmp_path: Path, capsys):
    page = tmp_path / "p.html"
    page.write_text("mine")
    code, _, err = run_cli(
        capsys, "patch", str(tmp_path / "no-such-model"), "--clean", "a", "--corrupted", "b",
        "--target", "c", "--html", str(page),
    )  # fmt: skip
    assert_one_error(code, err, "--html", "already exists")  # not "not found": no load tried
    assert page.read_text() == "mine"
    code, _, err = run_cli(
        capsys, "patch", str(tmp_path / "m"), "--clean", "a", "--corrupted", "b", "--target",
        "c", "--out", str(tmp_path / "o"), "--html", str(tmp_path / "o" / "patch-heads.png"),
    )  # fmt: skip
    assert_one_error(code, err, "--html", "the name of a PNG", "file name of its own")


@pytest.mark.parametrize("command", ["patch", "lens", "heads"])
def test_an_out_that_is_a_file_is_refused_before_any_work(tiny_run, tmp_path, capsys, command):
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    argv = {
        "patch": ["--clean", "ROMEO", "--corrupted", "JULIE", "--target", "a"],
        "lens": ["--text", "ROMEO"],
        "heads": ["--seq-len", "4", "--batch", "1"],
    }[command]
    for out in (mine, mine / "sub"):
        code, stdout, err = run_cli(capsys, command, str(tiny_run), *argv, "--out", str(out),
                                    "--device", "cpu")  # fmt: skip
        assert_one_error(code, err, f"--out {out}", "not a folder")
        assert "patching:" not in err and stdout == ""
    assert mine.read_text() == "mine"
