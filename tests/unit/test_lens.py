"""The logit lens and direct logit attribution (lmlab.analysis.lens) on tiny random models:
the lens's last row is the model's own output, a one-layer model whose sublayers write nothing
has a lens computable by hand (float64), the attribution sums to the real logit on every
block / norm / attention layout it accepts, each component equals the logit change of removing
it where nothing depends on it (no final norm), and every refusal names its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.analysis.lens import direct_logit_attribution, frozen_norm, logit_lens
from lmlab.errors import LmlabError
from lmlab.hooks import run_with_hooks
from lmlab.models import build_model
from lmlab.nn.norm import NORM
from tests.helpers import encoder_config, tiny_model_config

pytestmark = pytest.mark.usefixtures("one_thread")
V = 50

# the layouts the attribution must decompose exactly (each is a real code path of the sum)
DLA_CONFIGS = {
    "pre-layernorm-default": {},
    "pre-rmsnorm-swiglu": {"norm": {"kind": "rmsnorm"}, "ffn": {"kind": "swiglu"}},
    "layernorm-biases-learned-positions": {
        "norm": {"kind": "layernorm", "bias": True},
        "attention": {"n_heads": 4, "bias": True},
        "position": {"kind": "learned"},
    },
    "gqa": {"attention": {"n_heads": 4, "n_kv_heads": 2}},
    "parallel": {"block": {"parallel": True}},
    "differential": {"attention": {"kind": "differential", "n_heads": 4}},
    "mla": {"attention": {"kind": "mla", "n_heads": 4}},
    "moe": {"ffn": {"kind": "moe"}},
    "no-final-norm-untied": {"final_norm": False, "tie_embeddings": False},
    "sinusoidal-linear-attention": {
        "position": {"kind": "sinusoidal"},
        "attention": {"kind": "linear", "n_heads": 4},
    },
    "sink-attention": {"attention": {"kind": "sink", "n_heads": 4}},
    "nsa": {"attention": {"kind": "nsa", "n_heads": 4}},
}
WITH_POSITIONS = ("layernorm-biases-learned-positions", "sinusoidal-linear-attention")


def assert_near(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """max |got - want| <= atol (torch.testing.assert_close would import torch.distributed's
    tensor package on first use: seconds, for a plain comparison)."""
    assert got.shape == want.shape
    err = float((got.detach().double() - want.detach().double()).abs().max())
    assert err <= atol, f"max |difference| {err:.3g} > {atol}"


def spread(model: torch.nn.Module) -> torch.nn.Module:
    """Larger weights than the init, in place (logits of order 1-10, not 1e-2); norm weights
    away from 1 and biases away from 0, so a missing norm or bias shows. Returns ``model``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.add_(0.1 * torch.randn_like(p))
    return model


def model_of(seed: int = 0, **over: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return spread(build_model(tiny_model_config(vocab_size=V, **over)).eval())


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------- logit lens


@pytest.mark.parametrize(
    "over",
    [{}, DLA_CONFIGS["layernorm-biases-learned-positions"], {"block": {"kind": "hyper"}},
     {"block": {"kind": "post"}}],
    ids=["pre", "layernorm", "hyper", "post"],
)  # fmt: skip
def test_the_last_row_of_the_lens_is_the_models_own_output(over: dict, ids: torch.Tensor):
    model = model_of(**over)
    lens = logit_lens(model, ids, top_k=3)
    with torch.no_grad():
        logits = model(ids).logits  # a plain pass, no hooks
    assert lens.log_probs is not None and lens.log_probs.shape == (1, 3, 11, V)
    assert torch.equal(lens.log_probs[:, -1], F.log_softmax(lens.logits.float(), -1))
    assert_near(lens.logits, logits, 1e-5)
    assert torch.equal(lens.top_ids[:, -1, :, 0], logits.argmax(-1))
    assert lens.hooks == ["layers.0.hook_resid_pre", "layers.0.hook_resid_post",
                          "layers.1.hook_resid_post"]  # fmt: skip
    # the earlier rows differ from the output (the lens is not the output copied)
    assert not torch.allclose(lens.log_probs[:, 0], lens.log_probs[:, -1], atol=1e-3)


def test_an_encoders_lens_ends_in_its_mlm_head(ids: torch.Tensor):
    torch.manual_seed(0)
    model = build_model(encoder_config(vocab_size=V)).eval()
    lens = logit_lens(model, ids, top_k=2)
    with torch.no_grad():
        logits = model(ids).logits
    assert lens.log_probs is not None
    assert torch.equal(lens.log_probs[:, -1], F.log_softmax(logits.float(), -1))


def test_a_one_layer_model_whose_sublayers_write_nothing_has_the_hand_computed_lens():
    """Zero o_proj and down_proj: every row is the embedding's, log_softmax(W_U RMSNorm(E x)),
    computed here in float64 from the formula; the target's probability and rank by hand too."""
    model = model_of(n_layers=1, tie_embeddings=False, norm={"kind": "rmsnorm"})
    with torch.no_grad():
        model.layers[0].attn.o_proj.weight.zero_()
        model.layers[0].ffn.down_proj.weight.zero_()
        model.layers[0].ffn.down_proj.bias.zero_()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    lens = logit_lens(model, ids, top_k=4, targets=torch.tensor([[9, 2, 6, 5, 3]]))
    e = model.embed.weight.double()[ids[0]]  # (T, D); rope: no position added
    w, eps = model.final_norm.weight.double(), model.cfg.norm.eps
    normed = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + eps) * w
    ref = torch.log_softmax(normed @ model.lm_head.weight.double().T, -1)  # (T, V)
    assert lens.log_probs is not None
    for row in range(2):
        assert_near(lens.log_probs[0, row].double(), ref, 1e-5)
    assert torch.equal(lens.top_ids[0, 0], ref.topk(4, -1).indices)
    tgt = torch.tensor([9, 2, 6, 5, 3])
    want_p = ref.gather(-1, tgt[:, None]).squeeze(-1)
    want_rank = (ref > want_p[:, None]).sum(-1) + 1
    assert lens.target_probs is not None and lens.target_ranks is not None
    assert_near(lens.target_probs[0, 0].double(), want_p.exp(), 1e-6)
    assert torch.equal(lens.target_ranks[0, 0], want_rank)


def test_a_left_padded_row_has_the_lens_of_the_row_alone(ids: torch.Tensor):
    model = model_of()
    alone = logit_lens(model, ids[:, :7], top_k=2)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:, :7]], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)], 1)
    lens = logit_lens(model, padded, top_k=2, key_mask=mask)
    assert lens.log_probs is not None and alone.log_probs is not None
    assert_near(lens.log_probs[:, :, 3:], alone.log_probs, 1e-5)


# ----------------------------------------------------------------------------- attribution


@pytest.mark.parametrize("name", list(DLA_CONFIGS))
def test_the_attribution_sums_to_the_real_logit_and_logit_difference(name: str, ids):
    model = model_of(**DLA_CONFIGS[name])
    with torch.no_grad():
        logits = model(ids).logits[0]
    best, worst = logits.argmax(-1).tolist(), logits.argmin(-1).tolist()
    for target, versus, pos in ((best[-1], None, -1), (best[4], worst[4], 4)):
        d = direct_logit_attribution(model, ids, target, versus, pos)
        want = float(logits[pos, target] - (logits[pos, versus] if versus is not None else 0))
        assert d.actual == pytest.approx(want, abs=1e-5)
        assert abs(d.total - want) < 1e-4, (name, d.total, want)
        assert abs(want) > 0.05  # a sum worth checking
        n_heads = d.heads.shape[1]
        assert d.heads.shape == (2, 2 if name == "differential" else 4) and d.ffn.shape == (2,)
        assert sum(n.startswith("L0H") for n in d.names) == n_heads
    assert ("positions" in d.names) == (name in WITH_POSITIONS)
    assert ("final_norm.bias" in d.names) == (getattr(model.final_norm, "bias", None) is not None)
    assert ("L1.attn_bias" in d.names) == (name == "layernorm-biases-learned-positions")


def test_without_a_final_norm_each_last_layer_term_is_the_logit_change_of_removing_it(ids):
    """A parallel block: no later sublayer reads layer 1's attention or FFN output, and with no
    final norm the logit is linear in the residual, so zeroing head h's z (or the FFN output)
    changes the logit by exactly its attribution. A wrong head slice would fail this."""
    model = model_of(final_norm=False, block={"parallel": True})
    with torch.no_grad():
        model.layers[1].attn.o_proj.weight.mul_(10.0)  # heads' terms of order 0.1
        clean = float(model(ids).logits[0, 6, 5])
    target, pos = 5, 6
    d = direct_logit_attribution(model, ids, target, position=pos)

    def zero_head(h: int):
        def fn(z: torch.Tensor, _: str) -> torch.Tensor:
            z = z.clone()
            z[:, h] = 0.0
            return z

        return fn

    with torch.no_grad():
        for h in range(4):
            out = run_with_hooks(model, ids, {"layers.1.attn.hook_z": zero_head(h)})
            assert clean - float(out.logits[0, pos, target]) == pytest.approx(
                d[f"L1H{h}"], abs=1e-5
            )
        out = run_with_hooks(model, ids, {"layers.1.ffn.hook_out": lambda x, _: x * 0})
        assert clean - float(out.logits[0, pos, target]) == pytest.approx(d["L1.ffn"], abs=1e-5)
    assert d.scale == 1.0 and max(abs(d[f"L1H{h}"]) for h in range(4)) > 0.05


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_the_frozen_norm_rebuilds_the_norms_own_output(kind: str):
    cfg = tiny_model_config(vocab_size=V, norm={"kind": kind, "bias": kind == "layernorm"})
    norm = NORM.get(kind)(cfg)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(cfg.d_model) * 3 + 1
    linear, const, scale = frozen_norm(norm, x)
    y = linear(x.double()) + (const if const is not None else 0)
    assert_near(y.float(), norm(x).detach(), 1e-5)
    assert scale > 1.0  # the divisor of a spread-out vector, not 1


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"block": {"kind": "post"}}, "model.block.kind=post"),
        ({"block": {"kind": "hybrid"}}, "model.block.kind=hybrid"),
        ({"block": {"kind": "hyper"}}, "model.block.kind=hyper"),
        ({"block": {"residual": False}}, "residual=False"),
    ],
)
def test_blocks_whose_residual_is_not_a_sum_are_refused(over: dict, needle: str, ids):
    with pytest.raises(LmlabError, match="not a sum") as e:
        direct_logit_attribution(model_of(**over), ids, 3)
    assert needle in str(e.value)


def test_encoders_encoder_decoders_and_bad_arguments_are_refused(ids: torch.Tensor):
    enc = build_model(encoder_config(vocab_size=V)).eval()
    with pytest.raises(LmlabError, match="not linear"):
        direct_logit_attribution(enc, ids, 3)
    s2s = build_model(tiny_model_config(vocab_size=V, kind="encoder_decoder"))
    for fn in (lambda: logit_lens(s2s, ids), lambda: direct_logit_attribution(s2s, ids, 3)):
        with pytest.raises(LmlabError, match="model.kind=encoder_decoder"):
            fn()
    model = model_of()
    with pytest.raises(LmlabError, match="one sequence"):
        direct_logit_attribution(model, ids.repeat(2, 1), 3)
    with pytest.raises(LmlabError, match="position 11 is out of range: the text has 11"):
        direct_logit_attribution(model, ids, 3, position=11)
    with pytest.raises(LmlabError, match="versus token id 50 is outside"):
        direct_logit_attribution(model, ids, 3, versus=50)
    no_z = model_of()
    no_z.layers[1].attn.hook_z = None  # a kind that has no per-head output point
    with pytest.raises(LmlabError, match="model.attention.kind=softmax has no per-head output"):
        direct_logit_attribution(no_z, ids, 3)
    with pytest.raises(LmlabError, match="top_k must be 1..50"):
        logit_lens(model, ids, top_k=0)
    with pytest.raises(LmlabError, match="target token ids must be in 0..49"):
        logit_lens(model, ids, targets=-1)


def test_a_pre_norm_block_whose_stream_is_not_the_sum_is_caught_by_the_rebuild_check(ids):
    """The guard behind the block check: a block that scales its skip path (as a plugin might)
    passes the isinstance test, but its components no longer add up to the residual."""
    model = model_of()
    model.layers[0].add = lambda x, branch: 0.5 * x + branch  # type: ignore[method-assign]
    with pytest.raises(LmlabError, match="do not add up to the final residual"):
        direct_logit_attribution(model, ids, 3)


# ----------------------------------------------------------------------------- pictures


def test_the_lens_png_labels_short_inputs_cell_by_cell_and_caps_long_ones():
    from lmlab.analysis.attention_plot import MAX_FIGURE_INCHES
    from lmlab.analysis.lens_view import CELL_TEXT_MAX, plot_lens

    rows = ["embed", "layer 0", "layer 1"]
    short = plot_lens(torch.rand(3, 5), [list("abcde")] * 3, list("vwxyz"), rows)
    assert len(short.axes[0].texts) == 15  # every cell carries its top-1 token
    t = 200
    tokens = [f"w{i}" for i in range(t)]
    long = plot_lens(torch.rand(3, t), [tokens] * 3, tokens, rows)
    assert long.get_size_inches()[0] <= MAX_FIGURE_INCHES and t > CELL_TEXT_MAX
    assert len(long.axes[0].texts) == 0  # too many cells to write in
    ticks = [x.get_text() for x in long.axes[0].get_xticklabels()]
    step = int(ticks[1].split()[0])  # a round stride, each tick "POSITION token"
    assert step > 1 and ticks[:2] == ["0 w0", f"{step} w{step}"] and len(ticks) == t // step
