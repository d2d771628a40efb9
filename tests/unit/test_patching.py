"""Activation patching (lmlab.analysis.patching): patching a run into itself is exact at every
hook point (one at a time and all at once), the layer-0 residual carries the whole prompt
(score 1, the clean logits bit for bit), the last layer's residual at the last position
restores a last-position metric fully and earlier positions not at all, one score equals a
float64 computation by hand, batched patches equal one-at-a-time ones, left padding with a
key mask changes no score, and the refusals name their cause."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from lmlab.analysis import patching
from lmlab.analysis.patching import (
    Patch,
    logit_diff,
    metric,
    patch_activations,
    run_patched,
    target_log_prob,
)
from lmlab.errors import LmlabError
from lmlab.hooks import run_with_cache
from lmlab.models import build_model
from tests.helpers import encoder_config, tiny_model_config

pytestmark = pytest.mark.usefixtures("one_thread")
T, V = 7, 50


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=V)).eval()
    clean = torch.randint(0, V, (1, T))
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 11) % V  # one token differs
    return model, clean, corrupted


def test_logit_diff_and_log_prob_read_the_position_asked():
    logits = torch.zeros(1, 3, 4)
    logits[0, 1] = torch.tensor([1.0, 4.0, 2.0, 0.0])
    assert logit_diff(logits, 1, 2, position=1).tolist() == [2.0]
    assert logit_diff(logits[0], 1, 2, position=-2).tolist() == [2.0]  # (T, V) too
    lp = target_log_prob(logits, 1, position=1)
    assert lp.dtype == torch.float64
    want = 4.0 - torch.logsumexp(torch.tensor([1.0, 4.0, 2.0, 0.0], dtype=torch.float64), 0)
    assert float(lp[0]) == pytest.approx(float(want), abs=1e-12)
    assert torch.equal(metric(logits, 1, None, 1), lp)
    with pytest.raises(LmlabError, match="position 3"):
        logit_diff(logits, 1, 2, position=3)


@pytest.mark.parametrize("extra", [{}, {"attention": {"n_heads": 4, "n_kv_heads": 2}}],
                         ids=["mha", "gqa"])  # fmt: skip
def test_patching_every_activation_of_a_run_into_itself_gives_its_logits_exactly(extra):
    torch.manual_seed(1)
    model = build_model(tiny_model_config(vocab_size=V, **extra)).eval()
    ids = torch.randint(0, V, (1, T))
    fused = lambda n: not n.endswith(("hook_scores", "hook_pattern"))  # noqa: E731
    with torch.no_grad():
        plain = model(ids).logits
        _, cache = run_with_cache(model, ids, names=fused)  # the sdpa path, as plain runs
        names = [n for n in cache if n != "hook_logits"]
        assert len(names) >= 2 * 10  # every layer's points, both ends
        for name in names:  # one point at a time, every position
            got = run_patched(model, ids, cache, [[Patch(name)]])
            assert torch.equal(got, plain), name
        by_position = run_patched(model, ids, cache, [[Patch(n, t) for n in names
                                                       for t in range(T)]])  # fmt: skip
        assert torch.equal(by_position, plain)
        # every point at once, scores and patterns too: both runs take the math formula
        out, full = run_with_cache(model, ids)
        assert {"layers.1.attn.hook_pattern", "layers.1.attn.hook_scores"} <= set(full)
        everything = run_patched(model, ids, full, [[Patch(n) for n in full]])
        assert torch.equal(everything, out.logits)


def test_patching_the_first_residual_at_every_position_is_the_clean_run(setup):
    model, clean, corrupted = setup
    with torch.no_grad():
        out, cache = run_with_cache(model, clean, names=["layers.0.hook_resid_pre"])
        corrupt_logits = model(corrupted).logits
        got = run_patched(model, corrupted, cache, [[Patch("layers.0.hook_resid_pre")]])
    assert torch.equal(got, out.logits)
    assert not torch.equal(corrupt_logits, out.logits)
    m = [float(metric(x, 3, 5)[0]) for x in (out.logits, corrupt_logits, got)]
    assert (m[2] - m[1]) / (m[0] - m[1]) == 1.0
    # in the map: layer 0 at the one changed position restores everything, elsewhere nothing
    r = patch_activations(model, clean, corrupted, 3, 5, what=("resid_pre",))
    assert r.scores["resid_pre"][0, 2] == 1.0
    assert r.scores["resid_pre"][0, [0, 1, 3, 4, 5, 6]].abs().max() == 0.0
    assert r.scores["resid_pre"][:, :2].abs().max() == 0.0  # before the change: causal


@pytest.mark.parametrize("versus", [5, None], ids=["logit_diff", "log_prob"])
def test_the_last_residual_restores_the_last_position_and_nothing_before_it(setup, versus):
    model, clean, corrupted = setup
    r = patch_activations(model, clean, corrupted, 3, versus, what=("resid_post",))
    s = r.scores["resid_post"]
    assert s.shape == (2, T) and s.dtype == torch.float64
    assert r.metric_name == ("logit_diff" if versus else "log_prob")
    assert s[-1, -1] == 1.0  # final norm and unembedding act per position
    assert s[-1, :-1].abs().max() == 0.0  # no layer left to carry an earlier position
    assert abs(r.metric_clean - r.metric_corrupt) > 0


def test_a_last_layer_ffn_patch_scores_as_computed_by_hand_in_float64(setup):
    """Pre-norm block: resid_post = resid_mid + ffn_out, so patching the clean ffn_out at the
    last position gives logits lm_head(final_norm(resid_mid_corrupt + ffn_out_clean))."""
    model, clean, corrupted = setup
    r = patch_activations(model, clean, corrupted, 3, 5, what=("ffn_out",))
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        _, c = run_with_cache(ref, clean.clone(), names=lambda n: "hook_pattern" not in n)
        out_x, x = run_with_cache(ref, corrupted.clone(), names=["layers.1.hook_resid_mid"])
        last = "layers.1"
        resid = x[f"{last}.hook_resid_mid"][0, -1] + c[f"{last}.ffn.hook_out"][0, -1]
        logits = ref.lm_head(ref.final_norm(resid))
        ld = float(logits[3] - logits[5])
        ld_clean = float(c["hook_logits"][0, -1, 3] - c["hook_logits"][0, -1, 5])
        ld_corrupt = float(out_x.logits[0, -1, 3] - out_x.logits[0, -1, 5])
    want = (ld - ld_corrupt) / (ld_clean - ld_corrupt)
    assert abs(want) > 0.01 and want != 1.0  # a partial effect, not a trivial case
    assert float(r.scores["ffn_out"][1, -1]) == pytest.approx(want, abs=1e-5)
    assert r.metric_clean == pytest.approx(ld_clean, abs=1e-5)


def test_batched_patches_equal_one_at_a_time(setup, monkeypatch):
    model, clean, corrupted = setup
    calls: list[tuple[int, int]] = []
    batched = patch_activations(model, clean, corrupted, 3, 5, progress=lambda d, t:
                                calls.append((d, t)))  # fmt: skip
    single = patch_activations(model, clean, corrupted, 3, 5, ("resid_pre", "heads"), batch_size=1)
    assert set(batched.scores) == {"resid_pre", "attn_out", "ffn_out", "heads"}
    assert batched.scores["heads"].shape == (2, 4)
    for w, s in single.scores.items():
        torch.testing.assert_close(batched.scores[w], s, atol=1e-6, rtol=0)
    total = 3 * 2 * T + 2 * 4
    assert calls[-1] == (total, total) and len(calls) == 8  # one call per map row
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    # where layer 0's input is the same in both runs (every position but 2), restoring the
    # attention output there restores resid_post (= layer 1's resid_pre) exactly
    unchanged = [0, 1, 3, 4, 5, 6]
    s = batched.scores
    torch.testing.assert_close(s["attn_out"][0, unchanged], s["resid_pre"][1, unchanged],
                               atol=1e-6, rtol=0)  # fmt: skip
    assert s["attn_out"][0, 3:].abs().max() > 0.01  # and it is not the trivial 0 everywhere
    monkeypatch.setattr(patching, "LOGIT_BUDGET", 3 * T * V)  # 3 rows of logits per forward
    calls.clear()
    small = patch_activations(model, clean, corrupted, 3, 5, what=("resid_pre",),
                              progress=lambda d, t: calls.append((d, t)))  # fmt: skip
    assert [d for d, _ in calls] == [3, 6, 7, 10, 13, 14]  # each layer's row in 3 + 3 + 1
    torch.testing.assert_close(small.scores["resid_pre"], single.scores["resid_pre"], atol=1e-6,
                               rtol=0)  # fmt: skip
    with torch.no_grad():  # run_patched rows are independent of their neighbours
        _, cache = run_with_cache(model, clean, names=["layers.1.attn.hook_z"])
        rows = [[Patch("layers.1.attn.hook_z", head=h)] for h in range(4)]
        together = run_patched(model, corrupted, cache, rows)
        for h in range(4):
            alone = run_patched(model, corrupted, cache, [rows[h]])
            torch.testing.assert_close(together[h : h + 1], alone, atol=1e-6, rtol=0)


def test_left_padding_with_a_key_mask_changes_no_score(setup):
    model, clean, corrupted = setup
    plain = patch_activations(model, clean, corrupted, 3, 5, what=("resid_pre", "heads"))
    pad = torch.zeros(1, 2, dtype=torch.long)
    mask = torch.tensor([[0, 0] + [1] * T])
    padded = patch_activations(model, torch.cat([pad, clean], 1), torch.cat([pad, corrupted], 1),
                               3, 5, what=("resid_pre", "heads"), key_mask=mask)  # fmt: skip
    torch.testing.assert_close(padded.scores["resid_pre"][:, 2:], plain.scores["resid_pre"],
                               atol=1e-5, rtol=0)  # fmt: skip
    torch.testing.assert_close(padded.scores["heads"], plain.scores["heads"], atol=1e-5, rtol=0)


def test_refusals_name_their_cause(setup):
    model, clean, corrupted = setup
    with pytest.raises(LmlabError, match=r"clean prompt is 7 tokens and the corrupted one 6.*"
                                         r"same token length"):  # fmt: skip
        patch_activations(model, clean, corrupted[:, :6], 3, 5)
    with pytest.raises(LmlabError, match="on both the clean and the corrupted.*undefined"):
        patch_activations(model, clean, clean.clone(), 3, 5)
    with pytest.raises(LmlabError, match="unknown patch target.*'mlp'"):
        patch_activations(model, clean, corrupted, 3, 5, what=("mlp",))
    with pytest.raises(LmlabError, match=r"versus token id 50 is outside the vocabulary \(0..49\)"):
        patch_activations(model, clean, corrupted, 3, V)
    with pytest.raises(LmlabError, match="one sequence"):
        patch_activations(model, clean.expand(2, -1), corrupted.expand(2, -1), 3, 5)
    assert model.training is False
    model.train()
    patch_activations(model, clean, corrupted, 3, 5, what=("heads",))
    assert model.training is True  # its mode is put back
    model.eval()


@pytest.mark.parametrize(
    "kind, heads",
    [("moe", 4), ("differential", 2), ("hyper", 4), ("encoder", 4)],
)
def test_other_kinds_restore_the_changed_token_and_batch_to_float_rounding(kind, heads):
    """MoE runs each expert over the tokens routed to it, so a batched row differs from a
    single run by float rounding only (dropless routing: rows never compete); differential
    attention has H/2 heads of two maps each."""
    extra = {
        "moe": {"ffn": {"kind": "moe"}},
        "differential": {"attention": {"n_heads": 4, "kind": "differential"}},
        "hyper": {"block": {"kind": "hyper"}},
    }
    torch.manual_seed(0)
    cfg = encoder_config(vocab_size=V) if kind == "encoder" else tiny_model_config(V, **extra[kind])
    model = build_model(cfg).eval()
    clean = torch.randint(0, V, (1, T))
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 11) % V
    what = ("resid_pre", "heads")
    batched = patch_activations(model, clean, corrupted, 3, 5, what)
    single = patch_activations(model, clean, corrupted, 3, 5, ("heads",), batch_size=1)
    assert batched.scores["heads"].shape == (2, heads)
    assert float(batched.scores["resid_pre"][0, 2]) == pytest.approx(1.0, abs=1e-4)
    assert batched.scores["resid_pre"][0, [0, 1, 3, 4, 5, 6]].abs().max() < 1e-4  # no-ops
    torch.testing.assert_close(batched.scores["heads"], single.scores["heads"], atol=1e-4, rtol=0)


def test_a_long_cjk_map_is_labelled_at_a_stride_and_fits_the_figure_cap():
    from lmlab.analysis.attention_plot import MAX_FIGURE_INCHES
    from lmlab.analysis.patching_report import plot_map

    labels = [f"中{i}" for i in range(300)]
    fig = plot_map(torch.linspace(-2, 2, 3 * 300).reshape(3, 300), labels, "position")
    (ax,) = [a for a in fig.axes if a.get_label() == "map"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    # "POSITION label" at a stride; without a CJK font the label is its code point (a warning)
    zh = "中" if "中" in ticks[0] else "U+4E2D"
    assert 8 <= len(ticks) <= 150 and ticks[0] == f"0 {zh}0"
    assert all(re.fullmatch(rf"(\d+) {re.escape(zh)}\1", t) for t in ticks)
    assert max(fig.get_size_inches()) <= MAX_FIGURE_INCHES
    short = plot_map(torch.zeros(2, 4), ["a", "<b>", "满", "x"], "position")
    (ax,) = [a for a in short.axes if a.get_label() == "map"]
    full = "满" if zh == "中" else "U+6EE1"  # without a CJK font: the code point, as above
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "<b>", full, "x"]
    with pytest.raises(ValueError, match="3 column labels"):
        plot_map(torch.zeros(2, 4), ["a", "b", "c"], "position")
