"""Bad inputs to the interpretability commands on an encoder-decoder (``lens --source``, ``patch
--clean-source/--corrupted-source``, ``attention --source --window``) and to ``--window``: one
``error:`` line naming the flag, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.analysis.attention_maps import parse_window
from lmlab.errors import LmlabError
from tests.helpers import assert_one_error, run_cli

NOT_UTF8 = "ab\udcffcd"  # how Python hands over the byte 0xff of a command line


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["lens", "{run}", "--source", NOT_UTF8, "--text", "dc", "--no-plot"], "--source"),
        (["attention", "{run}", "--source", NOT_UTF8, "--no-plot"], "--source"),
        (["generate", "{run}", "--source", NOT_UTF8, "--temperature", "0"], "--source"),
        (["patch", "{run}", "--clean-source", NOT_UTF8, "--target", "d"], "--clean-source"),
        (
            ["patch", "{run}", "--clean-source", "abcd", "--corrupted-source", NOT_UTF8],
            "--corrupted-source",
        ),
    ],
)
def test_a_source_that_is_not_utf8_is_one_error_naming_the_flag(capsys, seq2seq_run, argv, flag):
    argv = [str(seq2seq_run) if a == "{run}" else a for a in argv]
    if argv[0] == "patch" and "--target" not in argv:
        argv += ["--target", "d"]
    code, _, err = run_cli(capsys, *argv)
    # before: "error: unexpected TypeError: TextInputSequence must be str" (exit 1)
    assert_one_error(code, err, f"{flag} is not UTF-8 text (byte 0xff at character")


def test_patch_on_an_encoder_decoder_without_a_source_names_clean_source(capsys, seq2seq_run):
    code, _, err = run_cli(capsys, "patch", seq2seq_run, "--target", "d", "--no-plot")
    assert_one_error(code, err, "--clean is required", "--clean-source")


@pytest.mark.parametrize("value", ["-1:3", "-2:", ":-1"])
def test_a_negative_window_is_one_error_of_lmlab_not_argparse(capsys, tiny_run, value):
    """argparse took "-1:3" after --window for an option ("expected one argument")."""
    code, _, err = run_cli(
        capsys, "attention", tiny_run, "--text", "First", "--window", value, "--no-plot"
    )
    assert_one_error(code, err, f"--window {value!r}", "count from 0")


def test_a_window_value_that_looks_like_a_flag_is_still_a_flag(capsys, tiny_run):
    code, _, err = run_cli(
        capsys, "attention", tiny_run, "--text", "First", "--window", "--no-plot"
    )
    assert_one_error(code, err, "--window: expected one argument")


@pytest.mark.parametrize(
    "bad", ["1_0:12", "\u0663:5", "3:\uff15", "- 1:3", "0x1:3", "1:2:3", "9" * 5000 + ":"]
)
def test_a_window_takes_plain_ascii_digits_only(bad):
    """int() reads '1_0' as 10 and Arabic-Indic or full-width digits as numbers, and raises
    ValueError past 4,300 digits (was 'unexpected ValueError')."""
    with pytest.raises(LmlabError, match="give START:END token positions"):
        parse_window(bad, 200)


def test_a_window_with_spaces_around_the_numbers_still_parses(tmp_path: Path):
    assert parse_window(" 1 : 3 ", 200) == (1, 3)
    assert parse_window(":", 200) == (0, None)


@pytest.mark.parametrize("top", ["1001", "100000000000"])
def test_lens_top_is_bounded(capsys, seq2seq_run, top):
    """--top 100000000000 was accepted: (rows, positions, min(k, vocab)) labels kept and printed,
    gigabytes for a real vocabulary and context."""
    code, _, err = run_cli(
        capsys, "lens", seq2seq_run, "--source", "abcd", "--text", "dc", "--top", top
    )
    assert_one_error(code, err, f"--top must be between 1 and 1000, got {top}")
