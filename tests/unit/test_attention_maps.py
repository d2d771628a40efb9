"""Attention-map metrics on hand-made matrices, heatmap panels, labels and fonts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lmlab.analysis.attention_maps import (
    BLURRED_ENTROPY_RATIO,
    COLLAPSED_MAX_WEIGHT,
    head_stats,
    self_attention_maps,
    token_label,
)
from lmlab.analysis.attention_plot import (
    font_families,
    panel_count,
    plot_heads,
    printable_labels,
    save_figure,
)
from lmlab.data.tokenizer import CharTokenizer
from lmlab.models import build_model
from lmlab.nn.masks import causal_mask
from tests.helpers import tiny_model_config


@pytest.mark.parametrize("n", [2, 3, 7, 100])
def test_entropy_of_a_uniform_row_is_log_n_and_the_head_is_blurred(n: int):
    # float64 weights: the only error left is float64 rounding of 1/n and of the sum
    (s,) = head_stats(torch.full((1, 1, n), 1.0 / n, dtype=torch.float64))
    assert s.entropy == pytest.approx(math.log(n), rel=1e-14, abs=0)
    assert s.entropy_max == pytest.approx(math.log(n), rel=1e-15, abs=0)
    assert s.blurred and not s.collapsed


def test_a_one_hot_row_has_zero_entropy_and_is_collapsed():
    w = torch.zeros(1, 1, 6)
    w[0, 0, 3] = 1.0
    (s,) = head_stats(w)
    assert s.entropy == 0.0 and s.max_weight == 1.0
    assert s.collapsed and not s.blurred


def test_distance_sink_and_entropy_on_a_hand_made_causal_matrix():
    w = torch.tensor([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    (s,) = head_stats(w, causal_mask(3, 3))
    # row 0 sees one key and is left out; rows 1 and 2 are averaged
    assert s.mean_distance == pytest.approx((0.5 * 1 + (0.2 * 2 + 0.3 * 1)) / 2)  # 0.6 tokens
    assert s.sink == pytest.approx((0.5 + 0.2) / 2)
    assert s.max_weight == pytest.approx(0.5)
    row2 = -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))
    assert s.entropy == pytest.approx((math.log(2) + row2) / 2)
    assert s.entropy_max == pytest.approx((math.log(2) + math.log(3)) / 2)  # uniform causal max
    assert s.blurred == (s.entropy >= BLURRED_ENTROPY_RATIO * s.entropy_max)


def test_a_head_reading_only_the_first_token_is_an_attention_sink_and_collapsed():
    t = 5
    w = torch.zeros(2, t, t)
    w[0, :, 0] = 1.0  # head 0: everything on token 0
    w[1] = causal_mask(t, t).float() / torch.arange(1, t + 1)[:, None]  # head 1: uniform causal
    sink, uniform = head_stats(w, causal_mask(t, t), layer=3)
    assert sink.sink == 1.0 and sink.collapsed and sink.layer == 3 and sink.head == 0
    assert sink.mean_distance == pytest.approx(sum(range(1, t)) / (t - 1))  # query i reads 0
    assert uniform.blurred and not uniform.collapsed
    assert uniform.entropy == pytest.approx(uniform.entropy_max)
    assert uniform.sink == pytest.approx(sum(1 / n for n in range(2, t + 1)) / (t - 1))


def test_cross_attention_shapes_take_separate_query_and_key_axes():
    w = torch.softmax(torch.randn(3, 2, 7), -1)  # 3 heads, 2 decoder queries, 7 encoder keys
    stats = head_stats(w, None, distance=False, heads=[4, 5, 6])
    assert [s.head for s in stats] == [4, 5, 6] and all(s.mean_distance is None for s in stats)
    assert all(s.entropy_max == pytest.approx(math.log(7)) for s in stats)


def test_bad_shapes_raise_value_errors():
    with pytest.raises(ValueError, match="heads, T_query, T_key"):
        head_stats(torch.ones(3, 3))
    with pytest.raises(ValueError, match="mask must be"):
        head_stats(torch.ones(1, 3, 3) / 3, torch.ones(2, 3, dtype=torch.bool))


def test_thresholds_are_the_documented_ones():
    assert (BLURRED_ENTROPY_RATIO, COLLAPSED_MAX_WEIGHT) == (0.9, 0.9)


def test_token_labels_show_whitespace_and_split_characters():
    assert token_label(b" a\n") == "␣a\\n"
    assert token_label("中".encode()) == "中"
    assert token_label("中".encode()[:2]) == "<e4 b8>"  # part of a character (byte-level BPE)


@pytest.mark.parametrize(("heads", "cols", "rows"), [(1, 1, 1), (3, 3, 1), (4, 4, 1), (6, 4, 2)])
def test_one_panel_per_head_in_a_grid(tmp_path: Path, heads: int, cols: int, rows: int):
    t = 5
    w = torch.softmax(torch.randn(heads, t, t).masked_fill(~causal_mask(t, t), -1e9), -1)
    labels = list("abcde")
    fig = plot_heads(w, labels, labels, mask=causal_mask(t, t), title="x")
    assert panel_count(fig) == heads
    panels = [ax for ax in fig.axes if ax.get_label().startswith("head ")]
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in panels} == {(rows, cols)}
    panel = next(ax for ax in fig.axes if ax.get_label() == "head 0")
    assert [x.get_text() for x in panel.get_xticklabels()] == labels
    path = save_figure(fig, tmp_path / "sub" / "m.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cross_attention_plots_with_different_query_and_key_labels():
    fig = plot_heads(torch.softmax(torch.randn(2, 2, 4), -1), ["q1", "q2"], list("wxyz"))
    panel = next(ax for ax in fig.axes if ax.get_label() == "head 1")
    assert [y.get_text() for y in panel.get_yticklabels()] == ["q1", "q2"]
    with pytest.raises(ValueError, match="labels"):
        plot_heads(torch.ones(1, 2, 4) / 4, ["q"], list("wxyz"))


def test_a_font_lacking_a_character_gets_an_installed_fallback_font():
    families, uncovered = font_families("жx", base="cmr10")  # cmr10 has no Cyrillic
    assert families[0] == "cmr10" and len(families) == 2 and not uncovered


def test_cjk_labels_get_a_cjk_font_or_code_points_with_a_warning(capsys):
    labels, families = printable_labels(["中", "a"])
    if len(families) == 2:  # a CJK font is installed
        assert labels == ["中", "a"]
    else:
        assert labels == ["U+4E2D", "a"]
        printable_labels(["文"])
        err = capsys.readouterr().err
        assert err.count("warning:") <= 1  # warned once per process at most


def test_self_attention_maps_of_a_model_are_causal_rows_of_probabilities():
    tok = CharTokenizer(sorted(set("满纸荒唐言 abc")))
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size)).eval()  # sdpa backend
    maps = self_attention_maps(model, tok, "满纸荒唐言 abc")
    assert len(maps.weights) == 2 and maps.weights[0].shape == (4, 9, 9)
    assert maps.query_labels[:5] == list("满纸荒唐言") and maps.query_labels[5] == "␣"
    for w in maps.weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(4, 9))
        assert (w.masked_select(~causal_mask(9, 9)) == 0).all()
    assert model.training is False
