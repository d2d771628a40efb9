import re
from pathlib import Path

import pytest

from lmlab.config import (
    RunConfig,
    config_from_dict,
    config_to_yaml,
    diff_configs,
    load_config,
)
from lmlab.errors import ConfigError


def test_defaults_are_the_minigpt_and_validate():
    cfg = RunConfig().validate()
    assert cfg.model.position.kind == "rope"
    assert cfg.model.block.kind == "pre"
    assert cfg.model.norm.kind == "layernorm"
    assert cfg.model.ffn.kind == "mlp" and cfg.model.ffn.activation == "gelu"
    assert cfg.model.d_ff == 4 * cfg.model.d_model


def test_unknown_field_names_the_field_and_the_allowed_ones():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"attention": {"n_head": 8}}})
    msg = str(e.value)
    assert "'model.attention.n_head'" in msg
    assert "did you mean 'n_heads'" in msg
    assert "n_kv_heads" in msg


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"model\.d_model: expected int, got 'big'"):
        config_from_dict({"model": {"d_model": "big"}})
    with pytest.raises(ConfigError, match=r"train\.compile: expected bool"):
        config_from_dict({"train": {"compile": 1}})


def test_unknown_kind_lists_registered_variants():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"position": {"kind": "ropee"}}}).validate()
    msg = str(e.value)
    assert "model.position.kind" in msg and "'ropee'" in msg
    for name in ("none", "sinusoidal", "learned", "rope"):
        assert name in msg


@pytest.mark.parametrize(
    "section, message",
    [
        ({"model": {"d_model": 100, "attention": {"n_heads": 3}}}, "divisible by"),
        ({"model": {"d_model": 384, "attention": {"n_heads": 6, "n_kv_heads": 4}}}, "multiple of"),
        ({"model": {"dropout": 1.5}}, r"model\.dropout must be in \[0, 1\)"),
        (
            {"train": {"precision": "fp16"}},
            r"train\.precision: 'fp16' is not allowed; allowed: bf16",
        ),
        ({"train": {"max_steps": 0}}, r"train\.max_steps must be > 0"),
        ({"train": {"lr": 1e-4, "min_lr": 1e-3}}, "must not exceed"),
        ({"model": {"ffn": {"activation": "swish"}}}, r"model\.ffn\.activation.*allowed: gelu"),
        (
            {"data": {"tokenizer": {"kind": "wordpiece"}}},
            r"data\.tokenizer\.kind.*allowed: char, bpe",
        ),
        (
            {"model": {"max_seq_len": 64}, "train": {"seq_len": 128}},
            "must not exceed model.max_seq_len",
        ),
    ],
)
def test_invalid_values_are_refused_with_the_field(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(section).validate()


def test_overrides_are_typed_and_dotted(tmp_path: Path):
    cfg = load_config(None, ["model.attention.n_heads=8", "train.compile=true", "train.lr=3e-4"])
    assert cfg.model.attention.n_heads == 8
    assert cfg.train.compile is True
    assert cfg.train.lr == pytest.approx(3e-4)
    with pytest.raises(ConfigError, match="expects dotted.key=value"):
        load_config(None, ["model.d_model"])
    with pytest.raises(ConfigError, match="unknown config field 'model.widht'"):
        load_config(None, ["model.widht=3"])


def test_yaml_round_trip_and_name_from_file(tmp_path: Path):
    cfg = load_config(None, ["model.n_layers=3"])
    p = tmp_path / "exp.yaml"
    p.write_text(config_to_yaml(cfg).replace("name: minigpt", "name: exp"))
    back = load_config(p)
    assert back == cfg.__class__(**{**back.__dict__}) and back.model.n_layers == 3
    assert diff_configs(cfg, back) == ["name"]


def test_config_file_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(scalar)


def test_shipped_configs_load():
    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "configs/ ships at least the default preset"
    for f in files:
        load_config(f)
    preset = load_config(root / "minigpt.yaml").model
    assert preset.tie_embeddings is False  # the default run's one model change (its recipe)
    preset.tie_embeddings = True
    assert preset == load_config(None).model  # otherwise the library's default model


def test_two_thirds_sizing_rule_for_gated_ffns():
    cfg = config_from_dict(
        {
            "model": {
                "d_model": 4096,
                "ffn": {"kind": "swiglu", "two_thirds": True, "multiple_of": 256},
            }
        }
    ).validate()
    assert cfg.model.d_ff == 11008  # Llama-7B: 256 * ceil(2/3 * 4 * 4096 / 256)
    cfg.model.ffn.multiple_of = 1
    assert cfg.model.d_ff == 10922
    cfg.model.ffn.d_ff = 100
    assert cfg.model.d_ff == 100  # an explicit d_ff wins


# ----------------------------------------------------------------------------- ranges and YAML


def test_every_numeric_field_has_a_range():
    """A new int or float config field fails here until FIELD_RANGES gives it an interval."""
    from lmlab.config import FIELD_RANGES, numeric_fields

    fields = numeric_fields()
    assert "train.lr" in fields and "model.norm.eps" in fields
    assert sorted(set(fields) - set(FIELD_RANGES)) == [], "numeric fields without a range"
    assert sorted(set(FIELD_RANGES) - set(fields)) == [], "ranges of fields that do not exist"


def _set_field(cfg: RunConfig, name: str, value: object) -> None:
    *path, last = name.split(".")
    node: object = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)


def _outside(r) -> list[float]:
    """Values just outside each end of a Range, plus NaN."""
    step = lambda x: max(abs(x) * 1e-6, 1e-12)  # noqa: E731
    low = r.low if r.low_open else r.low - step(r.low)
    high = r.high if r.high_open else r.high + step(r.high)
    return [low, high, float("nan")]


def _field_names():
    from lmlab.config import FIELD_RANGES

    return list(FIELD_RANGES)


@pytest.mark.parametrize("name", _field_names())
def test_each_numeric_field_refuses_values_outside_its_range(name):
    """check_ranges refuses both ends of every field's interval (and NaN), naming the field;
    the defaults lie inside."""
    from lmlab.config import FIELD_RANGES, check_ranges

    r = FIELD_RANGES[name]
    check_ranges(RunConfig())  # every default is in range
    for value in _outside(r):
        cfg = RunConfig()
        _set_field(cfg, name, value)
        with pytest.raises(ConfigError, match=rf"{re.escape(name)} must be in "):
            check_ranges(cfg)


def test_range_interval_notation():
    from lmlab.config import FIELD_RANGES

    assert str(FIELD_RANGES["model.dropout"]) == "[0, 1)"
    assert str(FIELD_RANGES["model.norm.eps"]) == "(0, 0.1]"
    assert 1.0 not in FIELD_RANGES["train.beta2"] and float("nan") not in FIELD_RANGES["train.lr"]


def test_shipped_experiments_use_aliases_within_the_bounds():
    from lmlab.experiments.spec import load_experiment

    root = Path(__file__).resolve().parents[2] / "experiments"
    exp = load_experiment(root / "moe.yaml")  # <<: *moe merges, with one field overridden
    assert exp.variants["moe-aux0.1"]["model.ffn.aux_loss_coef"] == 0.1
    assert exp.variants["moe-aux0.1"]["model.ffn.n_experts"] == 8
