"""``--plugin``: every examples/plugins/*.py through ``lmlab verify`` (good ones pass, broken ones
are caught by name), and the plugin flag's errors and its use by the other subcommands."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.nn import ATTENTION, POSITION
from tests.helpers import assert_one_error, run_cli

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
FILES = sorted(PLUGINS.glob("*.py"))
# the check each broken plugin must fail, on its own config (the table's first column)
CAUGHT = {"broken_peek": "causality", "broken_cache": "kv_cache"}


def rows(out: str) -> list[list[str]]:
    """The verify table's rows as [config, check, result, detail...]."""
    return [line.split() for line in out.splitlines()[1:-1]]


def test_the_examples_hold_good_and_broken_plugins():
    names = {f.stem for f in FILES}
    assert set(CAUGHT) <= names and {"xpos", "sigmoid_attention"} <= names
    assert all(f.with_suffix(".yaml").is_file() for f in FILES)


@pytest.mark.parametrize("plugin", FILES, ids=[f.stem for f in FILES])
def test_verify_passes_a_correct_plugin_and_names_what_a_broken_one_breaks(plugin, capsys):
    before = (ATTENTION.names(), POSITION.names())
    code, out, err = run_cli(
        capsys, "verify", "--plugin", plugin, "--config", plugin.with_suffix(".yaml")
    )
    assert "Traceback" not in out + err and not err.strip(), err
    table = rows(out)
    checked = {r[0] for r in table}
    assert plugin.stem in checked and any("[0]/decoder" in c for c in checked)  # config + examples
    failed = [(r[0], r[1]) for r in table if r[2] == "FAIL"]
    if plugin.stem in CAUGHT:
        assert code == 1
        assert (plugin.stem, CAUGHT[plugin.stem]) in failed, out
    else:
        assert code == 0 and not failed, out
        assert sum(r[2] == "pass" for r in table) >= 20
    assert (ATTENTION.names(), POSITION.names()) == before  # unregistered after the command


def test_a_plugin_file_that_is_missing_fails_to_import_or_registers_nothing_is_one_error(
    tmp_path, capsys
):
    code, _, err = run_cli(capsys, "verify", "--plugin", tmp_path / "nope.py")
    assert_one_error(code, err, "nope.py", "not a Python file")
    bad = tmp_path / "bad.py"
    bad.write_text("import math\n\ndef f():\n    raise ValueError('deep\\ninside')\n\nf()\n")
    code, _, err = run_cli(capsys, "verify", "--plugin", bad)
    assert_one_error(code, err, "bad.py", "importing it failed: ValueError: inside")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def (:\n")
    code, _, err = run_cli(capsys, "list", "--plugin", syntax)
    assert_one_error(code, err, "syntax.py", "SyntaxError")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    code, _, err = run_cli(capsys, "inspect", "--plugin", empty, PLUGINS / "xpos.yaml")
    assert_one_error(code, err, "empty.py", "registers no component")
    twice = tmp_path / "twice.py"  # a name lmlab already has
    twice.write_text(
        "from lmlab.nn.position import POSITION, RotaryPosition\n"
        "POSITION.register('rope')(RotaryPosition)\n"
    )
    code, _, err = run_cli(capsys, "list", "--plugin", twice)
    assert_one_error(code, err, "twice.py", "'rope' is registered twice")


def test_list_and_inspect_see_a_plugin_and_a_config_naming_it_needs_the_flag(capsys):
    xpos, config = PLUGINS / "xpos.py", PLUGINS / "xpos.yaml"
    code, out, _ = run_cli(capsys, "list", "position", "--plugin", xpos)
    assert code == 0 and "xpos" in out and "Sun et al. 2022" in out
    code, out, _ = run_cli(capsys, "inspect", config, "--plugin", xpos)
    assert code == 0 and "parameters" in out.lower()
    code, _, err = run_cli(capsys, "inspect", config)
    assert_one_error(code, err, "unknown position kind 'xpos'", "--plugin FILE.py")


def test_a_plugin_field_is_read_checked_by_the_plugin_and_refused_on_other_kinds(capsys):
    xpos, cfg = PLUGINS / "xpos.py", PLUGINS / "xpos.yaml"
    code, out, _ = run_cli(
        capsys, "inspect", cfg, "--plugin", xpos, "--set", "model.position.scale_base=64", "--json"
    )
    assert code == 0, out
    code, _, err = run_cli(
        capsys, "inspect", cfg, "--plugin", xpos, "--set", "model.position.scale_base=-1"
    )
    assert_one_error(code, err, "model.position.scale_base must be > 0")
    code, _, err = run_cli(
        capsys,
        *("inspect", cfg, "--plugin", xpos, "--set", "model.position.kind=rope"),
        *("--set", "model.position.scale_base=64"),
    )
    assert_one_error(code, err, "model.position.scale_base applies to kind=xpos only, not rope")
