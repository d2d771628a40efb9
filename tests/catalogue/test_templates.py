"""Chat templates and the tokenizer_config.json / generation_config.json that carry them
(tests/catalogue/README.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from catalogue_helpers import assert_one_error, assert_unchanged, run_cli, snapshot

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
