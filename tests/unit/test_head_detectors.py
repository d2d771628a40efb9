"""Head detectors (lmlab.analysis.head_detectors): each score equals its hand computation on
attention patterns built here, a hand-set previous-token head scores ~1 in a real model, and
every attention kind with a pattern (GQA, MQA, differential, sink, sigmoid, linear, mla,
encoders, encoder-decoders) gives the numbers its own attention weights give, in [0, 1]."""

from __future__ import annotations

import pytest
import torch

from lmlab.analysis.head_detectors import (
    DETECTORS,
    detect_heads,
    duplicate_token_pattern_scores,
    duplicate_token_scores,
    format_scores,
    induction_pattern_scores,
    induction_scores,
    previous_token_scores,
    repeated_random_tokens,
    sink_scores,
)
from lmlab.errors import LmlabError
from lmlab.models import build_model
from tests.helpers import encoder_config, tiny_model_config

pytestmark = pytest.mark.usefixtures("one_thread")


def causal_softmax(b: int, h: int, t: int, s: int | None = None) -> torch.Tensor:
    """(B, H, T, S) float64 random causal attention rows (key j visible to query i iff j <= i;
    with S = T + 1 the last column is always visible, like a learned sink)."""
    s = t if s is None else s
    logits = torch.randn(b, h, t, s, dtype=torch.float64) * 2
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    if s == t + 1:
        visible = torch.cat([visible, torch.ones(t, 1, dtype=torch.bool)], dim=1)
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def loop_mean(p: torch.Tensor, pairs: list[tuple[int, int]]) -> list[float]:
    """Per head: the plain mean of p[b, h, i, j] over b and the (i, j) pairs, by loops."""
    b, h = p.shape[:2]
    out = []
    for hi in range(h):
        vals = [float(p[bi, hi, i, j]) for bi in range(b) for i, j in pairs]
        out.append(sum(vals) / len(vals))
    return out


def test_each_pattern_score_is_its_hand_computed_mean():
    t, block = 10, 5
    p = causal_softmax(3, 4, t)
    prev = loop_mean(p, [(i, i - 1) for i in range(1, t)])
    sink = loop_mean(p, [(i, 0) for i in range(1, t)])
    ind = loop_mean(p, [(block + j, j + 1) for j in range(block)])
    dup = loop_mean(p, [(block + j, j) for j in range(block)])
    for got, want in [
        (previous_token_scores(p), prev),
        (sink_scores(p), sink),
        (induction_pattern_scores(p, block), ind),
        (duplicate_token_pattern_scores(p, block), dup),
    ]:
        assert got.dtype == torch.float64 and got.shape == (4,)
        assert got.tolist() == pytest.approx(want, rel=1e-13, abs=0)


def test_the_sink_column_score_is_the_last_columns_share():
    t = 7
    p = causal_softmax(2, 3, t, t + 1)
    want = loop_mean(p, [(i, t) for i in range(1, t)])
    assert sink_scores(p, sink_column=True).tolist() == pytest.approx(want, rel=1e-13, abs=0)
    assert sink_scores(p).tolist() == pytest.approx(loop_mean(p, [(i, 0) for i in range(1, t)]))


def test_ideal_heads_score_one_and_a_uniform_causal_head_scores_the_mean_of_1_over_i_plus_1():
    block = 4
    t = 2 * block
    p = torch.zeros(1, 4, t, t, dtype=torch.float64)
    p[0, 0, 0, 0] = 1.0
    for i in range(1, t):
        p[0, 0, i, i - 1] = 1.0  # head 0: previous token
    p[0, 1] = torch.ones(t, t).tril() / torch.arange(1, t + 1)[:, None]  # head 1: uniform
    p[0, 2, :, 0] = 1.0  # head 2: everything on the first token
    for i in range(t):  # head 3: induction on the second copy, itself before it
        p[0, 3, i, i - block + 1 if i >= block else i] = 1.0
    uniform = sum(1 / (i + 1) for i in range(1, t)) / (t - 1)
    # the first-token head's query 1 also reads its previous token: 1 of t - 1 rows
    assert previous_token_scores(p).tolist() == pytest.approx([1.0, uniform, 1 / (t - 1), 0.0])
    assert sink_scores(p).tolist() == pytest.approx([1 / (t - 1), uniform, 1.0, 0.0])
    uni_ind = sum(1 / (block + j + 1) for j in range(block)) / block
    assert induction_pattern_scores(p, block).tolist() == pytest.approx([0.0, uni_ind, 0.0, 1.0])
    assert duplicate_token_pattern_scores(p, block).tolist() == pytest.approx(
        [0.0, uni_ind, 1 / block, 0.0]  # the first copy of token 0 is key 0
    )


def test_malformed_patterns_are_refused():
    with pytest.raises(ValueError, match="B, H, T, S"):
        previous_token_scores(torch.ones(3, 3))
    with pytest.raises(ValueError, match="repeated twice"):
        induction_pattern_scores(torch.ones(1, 1, 6, 6), 4)


def test_repeated_random_tokens_repeat_distinct_non_special_tokens_and_follow_the_seed():
    ids = repeated_random_tokens(30, 12, 5, seed=3, avoid={0, 1, 2})
    assert ids.shape == (5, 24) and ids.dtype == torch.long
    assert torch.equal(ids[:, :12], ids[:, 12:])
    for row in ids[:, :12].tolist():
        assert len(set(row)) == 12 and not set(row) & {0, 1, 2} and max(row) < 30
    assert torch.equal(ids, repeated_random_tokens(30, 12, 5, seed=3, avoid={0, 1, 2}))
    assert not torch.equal(ids, repeated_random_tokens(30, 12, 5, seed=4, avoid={0, 1, 2}))
    with pytest.raises(LmlabError, match="27 non-special tokens"):
        repeated_random_tokens(30, 28, 1, avoid={0, 1, 2})


def previous_token_model() -> torch.nn.Module:
    """One layer, two heads of 16, learned positions, RMSNorm, zero token embeddings: head 0's
    q/k weights are set so query i matches only key i - 1; head 1's q is 0 (uniform)."""
    cfg = tiny_model_config(
        n_layers=1, max_seq_len=16, position={"kind": "learned"}, norm={"kind": "rmsnorm"},
        attention={"n_heads": 2},
    )  # fmt: skip
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.embed.weight.zero_()
        model.position.weight.copy_(torch.eye(16, 32))  # position i -> e_i; RMSNorm: sqrt(32) e_i
        attn = model.layers[0].attn
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        for i in range(16):
            attn.k_proj.weight[i, i] = 1.0  # head 0's key of position j: e_j (rows 0..15)
            if i >= 1:
                attn.q_proj.weight[i - 1, i] = 2.0  # query of position i: 2 e_{i-1}
    return model  # score(i, i-1) = 2 * 32 / sqrt(16) = 16 nats above every other key


def test_a_hand_set_previous_token_head_scores_one_and_a_uniform_head_its_exact_value():
    model = previous_token_model()
    scores = detect_heads(model, seq_len=8, batch=2, seed=1)
    assert [(s.layer, s.head) for s in scores] == [(0, 0), (0, 1)]
    built, uniform = scores
    assert built.previous_token > 0.9999 and built.kinds == ["previous_token"]
    assert built.induction < 1e-4 and built.duplicate_token < 1e-4
    assert built.sink == pytest.approx(1 / 15, abs=1e-4)  # query 1's previous token is key 0
    t = 16  # head 1 has q = 0: every row uniform over the keys it sees
    assert uniform.previous_token == pytest.approx(sum(1 / (i + 1) for i in range(1, t)) / 15)
    assert uniform.induction == pytest.approx(sum(1 / (8 + j + 1) for j in range(8)) / 8)
    assert uniform.kinds == []
    assert "previous-token heads (>= 0.4): L0H0 1.00" in format_scores(scores)
    ind = induction_scores(model, seq_len=8, batch=2, seed=1)
    assert ind.shape == (1, 2) and ind.tolist() == [[built.induction, uniform.induction]]
    dup = duplicate_token_scores(model, seq_len=8, batch=2, seed=1)
    assert dup.tolist() == [[built.duplicate_token, uniform.duplicate_token]]


def weights_scores(model: torch.nn.Module, seq_len: int, batch: int, seed: int) -> list[float]:
    """The four scores of every head from the model's own attention weights (need_weights),
    flattened in detect_heads' order (layer, head, detector)."""
    ids = repeated_random_tokens(model.cfg.vocab_size, seq_len, batch, seed)
    with torch.no_grad():
        if model.cfg.kind == "encoder_decoder":
            ws = model(input_ids=ids, decoder_input_ids=ids, need_weights=True).attentions
        else:
            ws = model(ids, need_weights=True).attentions
    t = 2 * seq_len
    pairs = {
        "previous_token": [(i, i - 1) for i in range(1, t)],
        "induction": [(seq_len + j, j + 1) for j in range(seq_len)],
        "duplicate_token": [(seq_len + j, j) for j in range(seq_len)],
        "sink": [(i, 0) for i in range(1, t)],
    }
    per = [{k: loop_mean(w.double(), pairs[k]) for k in DETECTORS} for w in ws]
    return [v for layer in per for h in range(len(layer["sink"])) for v in
            (layer[k][h] for k in DETECTORS)]  # fmt: skip


KINDS = {
    "mha": {},
    "gqa": {"attention": {"n_heads": 4, "n_kv_heads": 2}},
    "mqa": {"attention": {"n_heads": 4, "n_kv_heads": 1}},
    "differential": {"attention": {"kind": "differential", "n_heads": 4}},
    "sigmoid": {"attention": {"kind": "sigmoid", "n_heads": 4}},
    "mla": {"attention": {"kind": "mla", "n_heads": 4}},
    "sliding": {"attention": {"n_heads": 4, "mask": "sliding_window", "window": 5}},
    "local_global": {"attention": {"n_heads": 4, "mask": "local_global", "window": 3}},
    "streaming": {"attention": {"n_heads": 4, "mask": "streaming", "window": 6, "sink_tokens": 2}},
    "linear": {"attention": {"kind": "linear", "n_heads": 4}},
    "moba": {"attention": {"kind": "moba", "n_heads": 4, "moba_block_size": 4, "moba_top_k": 2}},
    "hyper": {"block": {"kind": "hyper"}},
}


@pytest.mark.parametrize("name", list(KINDS))
def test_random_init_scores_are_the_attention_weights_scores_in_0_1(name: str):
    """GQA and MQA score their 4 query heads; differential's 4 heads are its 2 first and 2
    second maps, numbered as its attention weights are; windowed masks still see i-1; moba runs
    its dense path while hooked; need_weights and the hooks read the same tensors."""
    model = build_model(tiny_model_config(**KINDS[name])).eval()
    scores = detect_heads(model, seq_len=8, batch=2, seed=5)
    assert len(scores) == 2 * 4
    got = [getattr(s, k) for s in scores for k in DETECTORS]
    assert all(0.0 <= v <= 1.0 for v in got)
    assert got == pytest.approx(weights_scores(model, 8, 2, 5), abs=1e-12)  # the same weights
    assert all(s.kinds == [] for s in scores)  # random init: nothing near 0.4


def test_an_encoder_and_an_encoder_decoders_decoder_are_scored_the_same_way():
    enc = build_model(encoder_config()).eval()
    got = [getattr(s, k) for s in detect_heads(enc, seq_len=8, batch=2) for k in DETECTORS]
    assert got == pytest.approx(weights_scores(enc, 8, 2, 0), abs=1e-12)
    assert all(v < 0.2 for v in got)  # bidirectional, random: ~1/16 per key
    s2s = build_model(tiny_model_config(kind="encoder_decoder")).eval()
    got = [getattr(s, k) for s in detect_heads(s2s, seq_len=8, batch=2) for k in DETECTORS]
    # decoder self-attention; float32 rounding apart: need_weights also switches cross-attention
    # to the math formula, the self-attention hooks do not
    assert got == pytest.approx(weights_scores(s2s, 8, 2, 0), abs=1e-7)


def test_the_sink_kinds_sink_score_is_the_share_its_learned_sink_takes():
    model = build_model(tiny_model_config(attention={"kind": "sink", "n_heads": 4})).eval()
    with torch.no_grad():
        model.layers[1].attn.sinks.copy_(torch.tensor([-2.0, 0.0, 2.0, 6.0]))
    scores = detect_heads(model, seq_len=8, batch=1)
    ids = repeated_random_tokens(model.cfg.vocab_size, 8, 1, 0)
    with torch.no_grad():
        ws = model(ids, need_weights=True).attentions  # (B, H, T, S), the sink column dropped
    for s in scores:
        left = 1.0 - ws[s.layer][0, s.head, 1:].double().sum(-1)  # what the sink took, i >= 1
        assert s.sink == pytest.approx(float(left.mean()), abs=1e-6)
    assert [s.sink > 0.4 for s in scores[4:]] == [False, False, True, True]  # sinks 2 and 6


def test_scores_on_a_text_are_added_when_given():
    model = previous_token_model()
    (built, uniform) = detect_heads(model, seq_len=4, batch=1, text_ids=[3, 9, 9, 4, 1])
    assert built.text_previous_token == pytest.approx(1.0, abs=1e-4)
    assert uniform.text_sink == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4)
    assert set(built.as_dict()) == {"layer", "head", *DETECTORS, "kinds", "text_previous_token",
                                    "text_sink"}  # fmt: skip


def test_nsa_and_bad_arguments_are_refused_by_name():
    nsa = build_model(tiny_model_config(attention={"kind": "nsa"}))
    with pytest.raises(LmlabError, match=r"kind=nsa has no attention pattern.*hook_pattern"):
        detect_heads(nsa, seq_len=4)
    model = build_model(tiny_model_config())
    for kwargs, needle in [
        ({"seq_len": 17}, "more than the model's context of 32"),
        ({"seq_len": 1}, "--seq-len must be >= 2"),
        ({"seq_len": 4, "batch": 0}, "--batch must be >= 1"),
        ({"seq_len": 4, "seed": -1}, "--seed"),
        ({"seq_len": 12, "avoid": range(40)}, "10 non-special tokens"),
        ({"seq_len": 4, "thresholds": {"induction": 2.0}}, "must be in"),
        ({"seq_len": 4, "thresholds": {"copying": 0.5}}, "unknown detector"),
        ({"seq_len": 4, "text_ids": [1]}, "--text is 1 tokens"),
    ]:
        with pytest.raises(LmlabError, match=needle):
            detect_heads(model, **kwargs)


def test_the_figure_has_one_annotated_layer_by_head_heatmap_per_detector():
    from lmlab.analysis.heads_report import plot_scores

    model = build_model(tiny_model_config()).eval()
    scores = detect_heads(model, seq_len=4, batch=1)
    fig = plot_scores(scores)
    panels = [ax for ax in fig.axes if ax.get_label() in DETECTORS]
    assert [ax.get_label() for ax in panels] == list(DETECTORS)
    for ax, det in zip(panels, DETECTORS, strict=True):
        assert ax.images[0].get_array().shape == (2, 4)  # layers x heads
        texts = [t.get_text() for t in ax.texts]
        assert texts == [f"{getattr(s, det):.2f}" for s in scores]  # layer-major, as drawn
