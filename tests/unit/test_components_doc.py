"""docs/components.md is generated from the registries and kept in step with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lmlab.analysis.components_doc import components_markdown, load_registries
from lmlab.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "components.md"


def test_components_md_is_the_generated_text() -> None:
    generated = components_markdown()
    assert DOC.read_text(encoding="utf-8") == generated, (
        "docs/components.md is stale: run `lmlab list --markdown > docs/components.md`"
    )


def test_list_markdown_prints_exactly_the_generated_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["list", "--markdown"]) == 0
    assert capsys.readouterr().out == components_markdown()


def test_every_registered_variant_has_a_row_with_its_description_and_field() -> None:
    text = components_markdown()
    for family, reg in load_registries().items():
        assert f"## {family}\n" in text
        if reg.field:
            assert f"Selected by `{reg.field}`." in text
        for name, doc in reg.describe().items():
            assert f"| `{name}` | {doc.replace('|', chr(92) + '|')} |" in text, (family, name)


def test_a_variant_registered_at_run_time_appears_with_no_list_edited() -> None:
    norm = load_registries()["norm"]

    class ScaleOnly(nn.Module):
        """x * weight with no centring or scaling by statistics (a docs-test variant)."""

        options = ("eps",)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    before = components_markdown()
    assert "scale_only" not in before
    norm.register("scale_only")(ScaleOnly)
    try:
        text = components_markdown()
        row = "| `scale_only` | x * weight with no centring or scaling by statistics "
        assert row + "(a docs-test variant). | `eps` |" in text
        # the options column appears for the family, empty for the variants without options
        assert "| name | what it is | options |" in text.split("## norm\n")[1].split("## ")[0]
    finally:
        norm.unregister("scale_only")
    assert components_markdown() == before


def test_family_notes_follow_the_table() -> None:
    reg = load_registries()["position"]
    section = components_markdown().split("## position\n")[1].split("\n## ")[0]
    assert reg.notes and section.index("| `rope` |") < section.index("Layout: half-split")
    assert "pairs (2i, 2i+1)" in section  # the interleaved RoPE layout is documented
