"""YAML configs, experiment files and ``--set`` overrides: each bad one gives one error line
naming the file (or flag) and the field, exit 2, fast, and nothing echoed whole
(tests/catalogue/README.md)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import TINY, assert_one_error, run_cli, within

# hints


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("model.n_heads=5", "model.attention.n_heads"),  # a field of a nested section
        ("model.n_kv_head=1", "model.attention.n_kv_heads"),  # ... misspelt
        ("model.rope_theta=1e4", "model.position.rope_theta"),
        ("model.n_layer=3", "n_layers"),  # a field of the section itself, by its name
        ("modle.d_model=8", "model"),
    ],
)
def test_unknown_field_suggests_the_field_meant(override, meant, tmp_path: Path, capsys):
    code, _, err = run_cli(capsys, "train", "--set", override, "--out", tmp_path / "r")
    assert_one_error(code, err, f"(did you mean {meant!r}?)")
    assert not (tmp_path / "r").exists()


# yaml and ranges

GUARD_S = 30  # an alias bomb expanded would run for hours; its refusal takes milliseconds


@pytest.fixture
def no_hang() -> Iterator[None]:
    with within(GUARD_S):  # a hang fails the test instead of stalling the suite
        yield


def _bomb(levels: int = 9, width: int = 10) -> str:
    """'Billion laughs': each level an alias list of the one before, width**levels leaves."""
    lines = ["x:", f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\nmodel: {{d_model: *l{levels - 1}}}\n"


def _write(tmp: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _inspect(config: Path, *extra: str) -> list[object]:
    """``lmlab inspect CONFIG``: reads and validates the config, builds and trains nothing (so a
    regression that accepts a bad config does not train)."""
    return ["inspect", config, *extra]


def _tiny(tmp: Path) -> Path:
    """The tiny config with one training step (should a bad --set be accepted after all)."""
    return _write(
        tmp, yaml.safe_dump({**TINY, "train": {**TINY["train"], "max_steps": 1}}), "t.yaml"
    )


def _experiment(tmp: Path, **changes: object) -> Path:
    exp = {"name": "e", "base": TINY, "variants": {"a": {}}, "seeds": [1], "budget": {"steps": 2}}
    return _write(tmp, yaml.safe_dump({**exp, **changes}), "exp.yaml")


def test_alias_bomb_config_is_refused_fast_and_not_echoed(capsys, tmp_path, no_hang):
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, _bomb())))
    line = assert_one_error(code, err, "bad.yaml", "100,000 YAML values", "aliases")
    assert "lol" not in line


def test_alias_bomb_in_set_is_refused_fast(capsys, tmp_path, no_hang):
    flow = "[&a [x,x,x,x,x,x,x,x,x,x]" + "".join(
        f", &{c} [{','.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    code, _, err = run_cli(capsys, *_inspect(_tiny(tmp_path), "--set", f"model.d_model={flow}]"))
    assert_one_error(code, err, "--set model.d_model", "YAML values")


def test_alias_bomb_experiment_is_refused_fast(capsys, tmp_path, no_hang):
    path = _write(tmp_path, _bomb().replace("model: {d_model:", "variants: {a:"), "exp.yaml")
    code, _, err = run_cli(capsys, "compare", path, "--out", tmp_path / "o")
    assert_one_error(code, err, "experiment file", "exp.yaml", "YAML values")


def test_alias_to_its_own_node_is_refused(capsys, tmp_path, no_hang):
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, "model: &m {ffn: *m}\n")))
    assert_one_error(code, err, "bad.yaml", "alias refers to a node that contains it")


def test_deep_nesting_is_refused(capsys, tmp_path, no_hang):
    text = "model: {d_model: " + "[" * 5000 + "]" * 5000 + "}\n"
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, text)))
    assert_one_error(code, err, "bad.yaml", "nest")


@pytest.mark.parametrize(
    "text, line",
    [
        ("model:\n  d_model: 64\n  d_model: 128\n", 3),
        ("train: {lr: 0.1}\nmodel: {}\ntrain: {lr: 0.2}\n", 3),
    ],
)
def test_duplicate_key_in_config_is_refused(capsys, tmp_path, text, line):
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, text)))
    assert_one_error(code, err, "bad.yaml", "repeats the key", f"line {line}")


def test_duplicate_key_in_experiment_is_refused(capsys, tmp_path):
    text = _experiment(tmp_path).read_text() + "seeds: [2]\n"
    path = _write(tmp_path, text, "exp.yaml")
    code, _, err = run_cli(capsys, "compare", path, "--smoke", "--out", tmp_path / "o")
    assert_one_error(code, err, "exp.yaml", "repeats the key 'seeds'")


def test_duplicate_key_in_set_value_is_refused(capsys, tmp_path):
    override = "model.attention={n_heads: 2, n_heads: 4}"
    code, _, err = run_cli(capsys, *_inspect(_tiny(tmp_path), "--set", override))
    assert_one_error(code, err, "--set model.attention", "repeats the key 'n_heads'")


def test_config_over_the_size_bound_is_refused(capsys, tmp_path):
    text = yaml.safe_dump(TINY) + ("# padding\n" * 120_000)  # 1.2 MB of comments
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, text)))
    assert_one_error(code, err, "bad.yaml", "1,048,576")


@pytest.mark.parametrize(
    "value, needle",
    [("9" * 5000, "digits"), ("2001-13-45", "month")],
)
def test_yaml_scalar_python_cannot_build_is_one_line(capsys, tmp_path, value, needle):
    text = f"model:\n  d_model: {value}\n"
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, text)))
    assert_one_error(code, err, "bad.yaml", "not valid YAML", needle)


def test_a_large_wrong_value_is_not_echoed_whole(capsys, tmp_path):
    text = "model:\n  d_model: [" + ", ".join(["abcdefgh"] * 20_000) + "]\n"
    code, _, err = run_cli(capsys, *_inspect(_write(tmp_path, text)))
    line = assert_one_error(code, err, "model.d_model: expected int")
    assert len(line) < 400, len(line)


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.norm.eps=0", "model.norm.eps"),
        ("model.norm.eps=1.0", "model.norm.eps"),
        ("model.init_std=.inf", "model.init_std"),
        ("model.init_std=5.0", "model.init_std"),
        ("train.lr=.inf", "train.lr"),
        ("train.lr=1e9", "train.lr"),
        ("train.weight_decay=.inf", "train.weight_decay"),
        ("train.grad_clip=.inf", "train.grad_clip"),
        ("model.position.rope_theta=.inf", "model.position.rope_theta"),
        ("model.max_seq_len=1000000000", "model.max_seq_len"),
        ("model.d_model=100000000", "model.d_model"),
        ("model.n_layers=1000000", "model.n_layers"),  # inspect ran for minutes
        ("model.attention.head_dim=100000", "model.attention.head_dim"),
        ("train.beta2=.nan", "train.beta2"),
        ("model.ffn.d_ff=10000000000", "model.ffn.d_ff"),
        ("model.vocab_size=1000000000", "model.vocab_size"),
        ("train.batch_size=100000000", "train.batch_size"),
        ("train.grad_accum_steps=100000000", "train.grad_accum_steps"),
        ("train.eval_batches=100000000", "train.eval_batches"),
        ("train.eval_every=100000000000", "train.eval_every"),
        ("train.max_steps=100000000000", "train.max_steps"),
        ("train.checkpoint_interval_s=.inf", "train.checkpoint_interval_s"),
        ("data.tokenizer.vocab_size=1000000000", "data.tokenizer.vocab_size"),
        ("model.ffn.aux_loss_coef=.inf", "model.ffn.aux_loss_coef"),
    ],
)
def test_numeric_field_out_of_range_is_refused(capsys, tmp_path, override, field):
    code, _, err = run_cli(capsys, *_inspect(_tiny(tmp_path), "--set", override))
    assert_one_error(code, err, field)


def test_explicit_vocab_size_that_differs_from_the_tokenizer_is_refused(capsys, tmp_path):
    """tinyshakespeare's char tokenizer has 65 tokens; 99 was once replaced by 65 silently."""
    argv = ["train", "--config", _tiny(tmp_path), "--out", tmp_path / "r"]
    code, _, err = run_cli(capsys, *argv, "--set", "model.vocab_size=99")
    assert_one_error(code, err, "model.vocab_size is 99", "65 tokens")
    assert not (tmp_path / "r" / "config.yaml").exists()


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"decode_tokens": 10**9}, "decode_tokens must be an integer >= 1 (at most"),
        ({"budget": {"steps": 10**12}}, "budget.steps must be a positive integer (at most"),
        ({"budget": {"tokens": 1e30}}, "budget.tokens must be a positive integer (at most"),
        ({"budget": {"time_s": 1e12}}, "budget.time_s must be a positive number of seconds"),
        ({"eval": {"batch_size": 10**9}}, "eval.batch_size must be an integer >= 1 (at most"),
    ],
)
def test_experiment_number_out_of_range_is_refused(capsys, tmp_path, changes, needle):
    path = _experiment(tmp_path, **changes)  # --smoke: 2 steps, should a bad value pass after all
    code, _, err = run_cli(capsys, "compare", path, "--smoke", "--out", tmp_path / "o")
    assert_one_error(code, err, "exp.yaml", needle)


# the file named with the field


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("model:\n  d_model: '32'\n", "model.d_model: expected int"),  # wrong type
        ("model:\n  d_model: 33\n", "model.d_model (33) must be divisible"),  # cross-field rule
    ],
)
def test_a_bad_field_of_a_config_file_names_the_file(capsys, tmp_path, text, field):
    """A field of a config file that fails its check: the error names the file and the field
    (was: the field alone, which for a run folder's config.yaml did not say which file)."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    code, _, err = run_cli(capsys, "train", "--config", config, "--out", tmp_path / "r")
    assert_one_error(code, err, f"config file {config}: {field}")


def test_a_bad_field_of_a_run_config_names_the_run_file(capsys, tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "config.yaml").write_text("model:\n  d_model: '32'\n")
    code, _, err = run_cli(capsys, "eval", run)
    assert_one_error(code, err, f"{run / 'config.yaml'}: model.d_model: expected int")


def test_a_bad_set_value_is_named_as_the_set_not_the_file(capsys, tmp_path):
    config = tmp_path / "ok.yaml"
    config.write_text("model:\n  d_model: 32\n")
    code, _, err = run_cli(
        capsys, "train", "--config", config, "--set", "model.d_model=33", "--out", tmp_path / "r"
    )
    line = assert_one_error(code, err, "model.d_model (33)")
    assert str(config) not in line


# presets that set an optimizer's or schedule's own fields, overridden by --set


@pytest.mark.parametrize(
    ("preset", "override", "fields"),
    [
        ("minigpt", "train.schedule=cosine", ["decay_fraction"]),
    ],
)
def test_switching_the_default_runs_optimizer_or_schedule_names_every_field_and_the_reset(
    preset, override, fields, tmp_path: Path, capsys
):
    """configs/minigpt.yaml (the default run) sets Muon's lr and WSD's decay fraction off
    their defaults; a --set that switches the optimizer or schedule leaves them set: one error
    naming them and the --set flags that reset them; with those flags the config passes."""
    from lmlab.config import load_config
    from lmlab.validation import validate_run_config

    config = str(Path(__file__).parents[2] / "configs" / f"{preset}.yaml")
    code, _, err = run_cli(
        capsys,
        "train",
        "--config",
        config,
        "--set",
        override,
        "--max-steps",
        "1",
        "--out",
        tmp_path / "r",
    )
    assert_one_error(code, err, *(f"train.{f}" for f in fields), "back to the default: --set")
    assert not (tmp_path / "r").exists()
    resets = err.split("back to the default: ")[1].split()
    assert resets[0::2] == ["--set"] * len(resets[1::2])
    validate_run_config(load_config(config, [override, *resets[1::2]]))  # now accepted


def test_the_default_run_switches_to_adamw_with_one_set():
    """configs/minigpt.yaml keeps Muon's fields at the library defaults (muon_lr 0.02 measured
    best), so `--set train.optimizer=adamw` alone is a valid config (the tutorial optimizer)."""
    from lmlab.config import load_config
    from lmlab.validation import validate_run_config

    config = str(Path(__file__).parents[2] / "configs" / "minigpt.yaml")
    cfg = load_config(config, ["train.optimizer=adamw"])
    validate_run_config(cfg)
    assert cfg.train.optimizer == "adamw"
