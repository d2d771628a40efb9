"""Bad experiment files and bad eval --lengths input: one error line naming the field, exit 2."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lmlab.cli import main
from lmlab.errors import ConfigError, LmlabError
from lmlab.experiments.compare import compare
from lmlab.experiments.spec import experiment_from_dict
from tests.e2e.test_compare import tiny_experiment, write_yaml


def bad(**changes):
    exp = tiny_experiment()
    for key, value in changes.items():
        if value is None:
            exp.pop(key)
        else:
            exp[key] = value
    return exp


CASES = [
    (
        bad(variants={"mha": {"model.attention.n_head": 2}}),
        r"variant 'mha': unknown config field 'model.attention.n_head' \(did you mean 'n_heads'",
    ),
    (bad(variants={"mha": {"model.position.kind": "rotary"}}), r"variant 'mha': .*'rotary'.*rope"),
    (bad(variants={}), "variants must map at least one name"),
    (bad(variants=None), "variants is missing"),
    (bad(variants={"a/b": {}}), "variant name 'a/b' must be a plain folder name"),
    (bad(variants={"mha": [1, 2]}), "variant 'mha' must map dotted fields to values"),
    (bad(budget={"steps": 2, "tokens": 100}), "budget sets steps and tokens; give exactly one"),
    (bad(budget={"steps": 0}), "budget.steps must be a positive integer"),
    (bad(budget={"steps": 2.5}), "budget.steps must be a positive integer"),
    (bad(budget={"time_s": -1}), "budget.time_s must be a positive number of seconds"),
    (bad(budget={"epochs": 1}), "budget.epochs is not a budget; allowed: steps, tokens, time_s"),
    (bad(budget={}), "budget must be a mapping with exactly one of"),
    (bad(seeds=[]), "seeds must be a non-empty list"),
    (bad(seeds=[1, 1]), "seeds repeat a value"),
    (bad(name="a/b"), "name 'a/b' must be a plain folder name"),
    (bad(extra=1), "unknown field 'extra'"),
    (bad(base="missing.yaml"), "base config not found"),
    (bad(eval={"lengths": [64, "x"]}), "eval.lengths: --lengths expects"),
    (bad(eval={"lenghts": [64]}), "eval.lenghts is unknown"),
    (
        bad(eval={"lengths": [64], "inference": {"x": {"variant": "nope", "set": {}}}}),
        "variant 'nope' is not a variant",
    ),
    (
        bad(
            eval={
                "lengths": [64],
                "inference": {"x": {"variant": "mha", "set": {"model.d_model": 8}}},
            }
        ),
        "only inference-time position settings",
    ),
    (bad(eval={"inference": {"x": {"variant": "mha"}}}), "eval.inference needs eval.lengths"),
    # was accepted: a run folder named with a newline, report.md's table row split in two
    (bad(variants={"a\nb": {}}), r"variant name 'a\\nb' must be a plain folder name \(no back"),
    (bad(variants={"a\x1b[31m": {}}), "must be a plain folder name"),
    (bad(name="x\ty"), r"name 'x\\ty' must be a plain folder name"),
    # was "variant name 1 must be a plain folder name (no slashes)"
    (bad(variants={1: {}}), "variant name 1 must be a string"),
]


def test_the_variants_example_is_printed_with_single_braces():
    """was: 'variants: {{base: {{}}, ...}}' (an f-string's escaping in a plain string)."""
    with pytest.raises(ConfigError) as e:
        experiment_from_dict(bad(variants=["a"]), Path("exp.yaml"))
    assert "{base: {}, wide: {model.d_model: 256}}" in str(e.value)


@pytest.mark.parametrize("raw, message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_experiment_is_refused_naming_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        experiment_from_dict(raw, Path("exp.yaml"))


def test_cli_bad_experiment_one_line_exit_2(tmp_path, capsys):
    spec = write_yaml(tmp_path / "e.yaml", bad(budget={"steps": 2, "time_s": 3}))
    code = main(["compare", str(spec), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "o").exists()  # nothing written before the file is valid
    assert main(["compare", str(tmp_path / "missing.yaml")]) == 2
    assert "experiment file not found" in capsys.readouterr().err


def test_out_of_another_comparison_is_refused(tmp_path):
    exp = tiny_experiment(variants={"mha": {}}, seeds=[1])
    out = tmp_path / "o"
    (out).mkdir()
    (out / "comparison.json").write_text(
        '{"name": "tinycmp", "smoke": false, "budget": {"steps": 9}}'
    )
    with pytest.raises(LmlabError, match="holds another comparison"):
        compare(experiment_from_dict(exp), out=out, log=lambda m: None)


def test_changed_variant_on_rerun_names_the_fields(tmp_path):
    exp = tiny_experiment(variants={"mha": {}}, seeds=[1])
    out = tmp_path / "o"
    compare(experiment_from_dict(exp), out=out, log=lambda m: None)
    changed = copy.deepcopy(exp)
    changed["variants"] = {"mha": {"model.d_model": 64, "train.lr": 1e-3}}
    with pytest.raises(LmlabError, match=r"mha seed 1: .*\(model.d_model, train.lr differ\)"):
        compare(experiment_from_dict(changed), out=out, log=lambda m: None)
    compare(experiment_from_dict(exp), out=out, log=lambda m: None)  # unchanged: accepted


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "0,64"], "--lengths expects comma-separated positive integers"),
        (["--lengths", "64", "--stride", "8"], "--stride cannot be combined with --lengths"),
        (["--set", "model.n_layers=3"], "only inference-time position settings"),
        (["--set", "model.position.scaling.kind=warp"], "model.position.scaling.kind"),
    ],
)
def test_eval_lengths_bad_input(tiny_run, argv, message, capsys):
    code = main(["eval", str(tiny_run), *argv, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_eval_lengths_model_folder_without_corpus_needs_data(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    code = main(["eval", str(tmp_path), "--lengths", "8"])
    assert code == 2
