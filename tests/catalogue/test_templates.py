"""Chat templates: hostile Jinja in a model file's ``tokenizer.chat_template`` meets the sandbox's
bounds (time, recursion, value and output size, template size, type) and ends with one error line;
what a template or a model prints cannot drive the terminal. The tokenizer_config.json and
generation_config.json that carry a template beside a run's tokenizer.json are checked too."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import lmlab.generation.chat_template as chat_template
from lmlab.cli import main
from tests.helpers import (
    assert_one_error,
    assert_unchanged,
    run_cli,
    snapshot,
    tiny_llama_hf,
    within,
    write_llama_gguf,
)

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_llama_hf()


def _gguf(tmp_path: Path, hf_model, template: object) -> Path:
    meta = {"tokenizer.chat_template": template}
    return write_llama_gguf(tmp_path / "t.gguf", hf_model, meta=meta)


def _chat(capsys, path: Path) -> tuple[int, str, str]:
    return run_cli(capsys, "generate", path, "--chat", "hi", "--max-new-tokens", "2")


HOSTILE = {
    # was "error: unexpected OverflowError: Range too big"
    "range-1e9": ("{% for i in range(10**9) %}x{% endfor %}", "1,048,576"),
    # was a hang: 10**10 empty iterations
    "nested-loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    # was "error: unexpected RecursionError"
    "recursion": ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "nested deeper"),
    # was a 1 GB allocation
    "str-times-1e9": ("{{ 'x' * 10**9 }}", "'*' would make"),
    "concat-doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "'~' would make",
    ),
    "center-1e9": ("{{ 'x'|center(10**9) }}", "center filter"),
    "ljust-1e9": ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    "percent-width": ("{{ '%0999999999d' % 1 }}", "format width"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "format width"),
    "replace-growth": (
        "{% set ns = namespace(s='x' * 1000) %}{% for i in range(10) %}"
        "{% set ns.s = ns.s|replace('', 'xxxxxxxxxx') %}{% endfor %}",
        "replace filter",
    ),
    "output-flood": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output exceeds"),
    "translate": ("{{ 'x'.translate({120: 'y' * 100000}) }}", "not offered"),
    "include-a-file": ("{% include '/etc/passwd' %}", "no loader"),
    "python-internals": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "syntax-error": ("{% for %}", "chat template failed"),
    "integer-power": ("{{ 2 ** 10000000 }}", "too large an integer"),
}


@pytest.mark.parametrize(("template", "needle"), HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_ends_quickly_with_one_error(
    tmp_path, capsys, monkeypatch, hf_model, template, needle
):
    if "longer than" in needle:  # the other cases end at their own bound, long before 2 s
        monkeypatch.setattr(chat_template, "MAX_SECONDS", 1.0)
    path = _gguf(tmp_path, hf_model, template)
    start = time.monotonic()
    with within(20):
        code, _, err = _chat(capsys, path)
    assert_one_error(code, err, "chat template", needle)
    assert time.monotonic() - start < 15


def test_a_template_that_is_not_a_string_is_refused(tmp_path, capsys, hf_model):
    path = _gguf(tmp_path, hf_model, 5)  # stored as a uint32; was rendered as the text "5"
    code, _, err = _chat(capsys, path)
    assert_one_error(code, err, "chat template is a int", "not Jinja source")


def test_a_template_over_the_size_bound_is_refused(tmp_path, capsys, hf_model):
    path = _gguf(tmp_path, hf_model, "x" * (chat_template.MAX_TEMPLATE_CHARS + 1))
    code, _, err = _chat(capsys, path)
    assert_one_error(code, err, "chat template is 1,048,577 characters")


def test_raise_exception_cannot_fake_error_lines_or_drive_the_terminal(tmp_path, capsys, hf_model):
    template = "{{ raise_exception('\\x1b[2J\\x1b]0;owned\\x07\\rerror: fake\\nerror: second') }}"
    path = _gguf(tmp_path, hf_model, template)
    code, _, err = _chat(capsys, path)
    line = assert_one_error(code, err, "refused the conversation", "\\x1b[2J", "\\nerror: second")
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    assert line.count("error:") == 3  # our prefix and the two quoted, all on one line


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_printed_to_a_terminal_has_control_characters_escaped(tmp_path, monkeypatch, hf_model):
    path = _gguf(tmp_path, hf_model, "{{ messages[0]['content'] }}")
    prompt = "\x1b[2Jclear\rover"
    for stream, expected in ((_Tty(), "\\x1b[2Jclear\\x0dover"), (io.StringIO(), prompt)):
        monkeypatch.setattr("sys.stdout", stream)
        assert main(["generate", str(path), "--prompt", prompt, "--max-new-tokens", "1"]) == 0
        assert stream.getvalue().startswith(expected)  # a pipe or file gets the bytes as they are


# tokenizer_config.json and generation_config.json beside a run's tokenizer.json


@pytest.mark.parametrize(
    ("name", "value", "needles"),
    [
        ("tokenizer_config.json", {"chat_template": 7}, ("chat_template must be a string",)),
        ("tokenizer_config.json", {"eos_token": "<|im_end|>"}, ("eos_token", "is not a token")),
        ("tokenizer_config.json", {"bos_token": ["a"]}, ("bos_token must be a token's text",)),
        ("tokenizer_config.json", [1, 2], ("must hold a JSON object",)),
        ("generation_config.json", {"eos_token_id": 10**9}, ("eos_token_id must be ids in",)),
    ],
    ids=["template-not-text", "eos-not-in-vocab", "bos-a-list", "not-an-object", "stop-id-big"],
)
def test_bad_tokenizer_config_gives_one_error(
    name, value, needles, tiny_run: Path, tmp_path: Path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    if name == "generation_config.json":
        (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    (run / name).write_text(json.dumps(value))
    before = snapshot(run)
    code, out, err = run_cli(capsys, "generate", run, "--chat", "hi", "--max-new-tokens", "2")
    assert_one_error(code, err, str(run / name), *needles)
    assert out == ""
    assert_unchanged(run, before)
