"""YAML configs and ``--set`` overrides (tests/catalogue/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from catalogue_helpers import assert_one_error, run_cli

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
