"""lmlab.validation: the registries' declared options and checks validate a config, and
config.py, the schema, knows no component (a variant with fields of its own needs no edit there)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing

import pytest
import torch

from lmlab.config import (
    ModelConfig,
    PositionConfig,
    RunConfig,
    config_from_dict,
    config_to_yaml,
    load_config,
)
from lmlab.errors import ConfigError
from lmlab.models.build import build_model
from lmlab.nn.position import POSITION, PositionEncoding, sinusoidal_table
from lmlab.validation import config_families, default_of, section_of
from tests.helpers import TINY, tiny_config, tiny_model_config

# ----------------------------------------------------------------------------- the generic rule


def _changed(section: object, name: str) -> object:
    """A value of field ``name`` of ``section`` other than its default, of the field's type."""
    default = default_of(section, name)
    if dataclasses.is_dataclass(default):  # a nested section: change its first plain field
        inner = dataclasses.fields(default)[1].name
        return dataclasses.replace(default, **{inner: _changed(default, inner)})  # type: ignore[type-var]
    hints = typing.get_type_hints(type(section))
    tp = hints.get(name, type(default))
    kinds = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if bool in kinds:
        return not default
    if int in kinds:
        return (default or 0) + 1
    if float in kinds:
        return (default or 0.0) + 0.5
    return "bert" if default is None else f"{default}_other"


def _foreign_cases() -> list[tuple[str, str, str]]:
    """(family field, option, a kind of that family not declaring it) for every option any
    registered kind declares: a new variant's options are covered with no list to edit."""
    cases = []
    for field, reg in config_families():
        for kind in reg:
            own = reg.contract(kind).options
            for name in reg:
                cases += [(field, o, kind) for o in reg.contract(name).options if o not in own]
    return sorted(set(cases))


FOREIGN = _foreign_cases()


def test_every_family_with_options_is_covered():
    fields = {f for f, _, _ in FOREIGN}
    for field in ("model.kind", "model.position.kind", "model.position.scaling.kind"):
        assert field in fields
    for field in ("model.attention.mask", "model.ffn.kind", "data.tokenizer.kind"):
        assert field in fields
    assert "train.objective" in fields


@pytest.mark.parametrize(("field", "option", "kind"), FOREIGN, ids=[":".join(c) for c in FOREIGN])
def test_an_option_on_a_kind_that_does_not_read_it_is_refused_naming_its_owners(
    field, option, kind
):
    cfg = RunConfig()
    *path, key = field.split(".")
    setattr(section_of(cfg, field), key, kind)
    section = section_of(cfg, field)
    setattr(section, option, _changed(section, option))
    reg = dict(config_families())[field]
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    prefix = field.rsplit(".", 1)[0]
    assert msg.startswith(f"{prefix}.{option} applies to "), msg
    assert f"only, not {kind}" in msg
    for owner in reg.owners(option):
        assert re.search(rf"\b{re.escape(owner)}\b", msg.split(" only,")[0]), (owner, msg)


def test_an_option_left_at_its_default_is_accepted_on_any_kind():
    """Shipped configs spell every field out: the MoE fields with ffn.kind=mlp pass."""
    cfg = load_config("configs/minigpt.yaml")
    assert cfg.model.ffn.kind == "mlp" and cfg.model.ffn.n_experts == 8
    tiny_config(model={"position": {"kind": "alibi", "rope_theta": 10000.0}})


def test_owner_and_selected_kind_are_named():
    with pytest.raises(ConfigError, match=r"^model\.position\.offset applies to kind=learned only"):
        tiny_config(model={"position": {"kind": "rope", "offset": 2}})
    with pytest.raises(ConfigError, match=r"kinds linear, ntk, dynamic_ntk, yarn only, not none"):
        tiny_config(model={"position": {"scaling": {"factor": 2.0}}})
    with pytest.raises(ConfigError, match=r"model\.ffn\.n_experts applies to kind=moe only"):
        tiny_config(model={"ffn": {"kind": "mlp", "n_experts": 4}})


@pytest.mark.parametrize(
    ("ffn", "field", "kind", "fixed"),
    [
        ({"kind": "swiglu", "activation": "relu"}, "model.ffn.kind", "swiglu", "silu"),
        ({"kind": "geglu", "activation": "silu"}, "model.ffn.kind", "geglu", "gelu"),
        (
            {"kind": "moe", "expert": "swiglu", "activation": "relu"},
            "model.ffn.expert",
            "swiglu",
            "silu",
        ),
    ],
)
def test_an_activation_a_gated_kind_fixes_is_refused_by_name(ffn, field, kind, fixed):
    """swiglu / geglu fix their gate activation: another model.ffn.activation had no effect."""
    act = ffn["activation"]
    key = field.rsplit(".", 1)[1]
    with pytest.raises(ConfigError) as e:
        tiny_config(model={"ffn": {"d_ff": 16, **ffn}})
    assert str(e.value).startswith(
        f"model.ffn.activation applies to {key}s mlp, gated only, not {kind} "
        f"(activation={act} has no effect with {field}={kind}, whose gate activation is {fixed})"
    ), str(e.value)
    assert f"use {field}=gated" in str(e.value)


@pytest.mark.parametrize(
    "ffn",
    [
        {"kind": "swiglu"},
        {"kind": "swiglu", "activation": "gelu"},  # the default, as a saved config spells it
        {"kind": "geglu", "activation": "gelu"},
        {"kind": "gated", "activation": "relu"},
        {"kind": "mlp", "activation": "relu"},
        {"kind": "moe", "expert": "mlp", "activation": "relu"},
        {"kind": "moe", "expert": "gated", "activation": "silu"},
    ],
)
def test_an_activation_the_ffn_reads_or_the_default_is_accepted(ffn):
    tiny_config(model={"ffn": {"d_ff": 16, **ffn}})


def test_an_encoder_mlm_head_reads_the_activation_whatever_the_ffn_kind():
    """The encoder's MLM head applies model.ffn.activation: accepted with swiglu (and read),
    refused once the head is off."""
    from lmlab.validation import validate_model

    def encoder(act: str, **more: object) -> ModelConfig:
        ffn = {"kind": "swiglu", "d_ff": 16, "activation": act}
        attn = {"n_heads": 4, "mask": "bidirectional"}
        m = dict(TINY["model"], kind="encoder", attention=attn, ffn=ffn, vocab_size=50, **more)
        cfg = config_from_dict({"model": m}).model
        validate_model(cfg)
        return cfg

    outs = []
    for act in ("gelu", "relu"):
        torch.manual_seed(0)
        net = build_model(encoder(act)).eval()
        with torch.no_grad():
            outs.append(net(torch.arange(12).unsqueeze(0) % 50).logits)
    assert not torch.allclose(*outs)
    with pytest.raises(ConfigError, match=r"model\.ffn\.activation applies to kinds mlp, gated"):
        encoder("relu", mlm_head=False)


# ----------------------------------------------------------------------------- options are read


def _logits(**model: object) -> torch.Tensor:
    torch.manual_seed(0)
    net = build_model(tiny_model_config(**model)).eval()
    with torch.no_grad():
        return net(torch.arange(12).unsqueeze(0) % 50).logits


@pytest.mark.parametrize(
    ("base", "changed"),
    [
        ({"kind": "rope"}, {"kind": "rope", "rope_theta": 500.0}),
        ({"kind": "rope"}, {"kind": "rope", "interleaved": True}),
        ({"kind": "rope"}, {"kind": "rope", "partial_rotary_factor": 0.5}),
        ({"scaling": {"kind": "linear"}}, {"scaling": {"kind": "linear", "factor": 4.0}}),
        ({"kind": "t5_relative"}, {"kind": "t5_relative", "max_distance": 4, "num_buckets": 4}),
    ],
)
def test_a_declared_position_option_changes_the_output(base, changed):
    """Each option the kind declares is read: changing it changes the logits."""
    assert not torch.allclose(_logits(position=base), _logits(position=changed))


def test_the_window_and_moe_options_are_read():
    sliding = {"n_heads": 4, "mask": "sliding_window"}
    a = _logits(attention={**sliding, "window": 2})
    assert not torch.allclose(a, _logits(attention={**sliding, "window": 8}))
    moe = {"kind": "moe", "n_experts": 4, "d_ff": 16}
    assert not torch.allclose(_logits(ffn={**moe, "top_k": 1}), _logits(ffn={**moe, "top_k": 2}))


def test_learned_offset_adds_table_rows():
    net = build_model(tiny_model_config(position={"kind": "learned", "offset": 2}))
    assert net.position.weight.shape[0] == 32 + 2


# ----------------------------------------------------------------------------- a plugin variant


class ScaledSinusoidal(PositionEncoding):
    """Sinusoidal positions times ``model.position.amplitude`` (a test variant)."""

    fields = {"amplitude": (float, 1.0)}

    @staticmethod
    def check(m: ModelConfig) -> None:
        if not m.position.amplitude > 0:
            raise ConfigError(f"model.position.amplitude must be > 0, got {m.position.amplitude}")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.d_model, self.amplitude = cfg.d_model, cfg.position.amplitude

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + self.amplitude * sinusoidal_table(positions, self.d_model).to(x.dtype)


@pytest.fixture
def scaled_sinusoidal():
    POSITION.register("scaled_sinusoidal")(ScaledSinusoidal)
    yield "scaled_sinusoidal"
    POSITION.unregister("scaled_sinusoidal")


def _with_position(position: dict) -> RunConfig:
    data = {**TINY, "model": {**TINY["model"], "position": position}}
    return config_from_dict(data)


def test_a_variant_field_parses_reads_and_defaults_with_no_config_edit(scaled_sinusoidal):
    cfg = _with_position({"kind": scaled_sinusoidal, "amplitude": 3}).validate()
    assert cfg.model.position.amplitude == 3.0 and isinstance(cfg.model.position.amplitude, float)
    assert _with_position({"kind": scaled_sinusoidal}).validate().model.position.amplitude == 1.0
    assert PositionConfig().amplitude == 1.0  # declared default on any section
    with pytest.raises(ConfigError, match=r"model\.position\.amplitude: expected float"):
        _with_position({"kind": scaled_sinusoidal, "amplitude": "loud"})


def test_a_variant_field_is_validated_by_its_check_and_refused_on_other_kinds(scaled_sinusoidal):
    with pytest.raises(ConfigError, match=r"model\.position\.amplitude must be > 0, got -1\.0"):
        _with_position({"kind": scaled_sinusoidal, "amplitude": -1.0}).validate()
    with pytest.raises(
        ConfigError, match=r"model\.position\.amplitude applies to kind=scaled_sinusoidal only"
    ):
        _with_position({"kind": "rope", "amplitude": 2.0}).validate()
    assert ("model.position.kind", "amplitude", "rope") in _foreign_cases()


def test_a_variant_field_round_trips_through_yaml_and_is_read_by_the_model(scaled_sinusoidal):
    cfg = _with_position({"kind": scaled_sinusoidal, "amplitude": 2.5}).validate()
    text = config_to_yaml(cfg)
    assert "amplitude: 2.5" in text
    import yaml

    again = config_from_dict(yaml.safe_load(text)).validate()
    assert again == cfg and again.model.position.amplitude == 2.5
    assert "amplitude" not in config_to_yaml(RunConfig())  # written for the kind declaring it
    unset_cfg = _with_position({"kind": scaled_sinusoidal})
    unset = config_to_yaml(unset_cfg)
    assert "amplitude: 1.0" in unset
    # unset and written-out default are one config (the contract's YAML round trip)
    assert config_from_dict(yaml.safe_load(unset)) == unset_cfg
    assert _with_position({"kind": scaled_sinusoidal, "amplitude": 1.0}) == unset_cfg
    cfg.model.vocab_size = 50
    x = torch.zeros(1, 4, 32)
    pos = build_model(cfg.model).position
    torch.testing.assert_close(
        pos.embed(x, torch.arange(4))[0], 2.5 * sinusoidal_table(torch.arange(4), 32)
    )


def test_an_unknown_field_is_still_refused_with_did_you_mean(scaled_sinusoidal):
    with pytest.raises(ConfigError, match=r"unknown config field 'model\.position\.amplitud'"):
        _with_position({"kind": scaled_sinusoidal, "amplitud": 2.0})


def test_after_unregistering_the_field_is_unknown():
    with pytest.raises(ConfigError, match="unknown config field 'model.position.amplitude'"):
        _with_position({"kind": "rope", "amplitude": 2.0})


# ----------------------------------------------------------------------------- dependency direction


def test_importing_the_config_schema_imports_no_component():
    code = (
        "import sys, lmlab.config\n"
        "from lmlab.config import RunConfig, config_from_dict\n"
        "config_from_dict({'model': {'d_model': 64}})\n"
        "bad = [m for m in sys.modules if m.split('.')[:2] in (['lmlab', 'nn'], ['lmlab', "
        "'models'], ['lmlab', 'data'], ['lmlab', 'training'], ['lmlab', 'interop'])]\n"
        "print(bad, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"


def test_moved_names_are_still_importable_from_lmlab_config():
    from lmlab import config, config_ranges, validation

    assert config.FIELD_RANGES is config_ranges.FIELD_RANGES
    assert config.validate_run_config is validation.validate_run_config
    assert config.MAX_TOKENS == 1 << 24 and config.check_ranges is config_ranges.check_ranges
    with pytest.raises(AttributeError):
        config.no_such_name  # noqa: B018


def test_validate_model_checks_a_model_config_alone():
    from lmlab.config import NormConfig
    from lmlab.validation import validate_model

    validate_model(ModelConfig())
    with pytest.raises(ConfigError, match=r"model\.d_model \(30\) must be divisible"):
        validate_model(ModelConfig(d_model=30))
    with pytest.raises(ConfigError, match=r"model\.norm\.eps must be in \(0, 0\.1\]"):
        validate_model(ModelConfig(norm=NormConfig(eps=1.0)))  # the ranges, model fields only
    with pytest.raises(ConfigError, match=r"model\.position\.offset applies to kind=learned"):
        validate_model(ModelConfig(position=PositionConfig(offset=2)))
