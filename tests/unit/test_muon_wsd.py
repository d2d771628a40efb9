"""train.optimizer: muon (torch.optim.Muon's update, batched by shape, on the blocks' matrices,
AdamW on the rest) and
train.schedule: wsd (warmup-stable-decay)."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmlab.config import ModelConfig, TrainConfig
from lmlab.errors import ConfigError
from lmlab.models import build_model
from lmlab.training import checkpoint as ck
from lmlab.training.memory import estimate_training_memory
from lmlab.training.optim import (
    AdamW,
    GroupedMuon,
    MuonWithAdamW,
    build_optimizer,
    lr_at,
    muon_param_names,
    set_lr,
)
from tests.helpers import assert_one_error, run_cli, snapshot, tiny_config

NS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024's quintic coefficients


def newton_schulz_reference(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Float64 Newton-Schulz orthogonalisation of ``u`` (R, C) as published (Keller Jordan's
    muon.py): X = u / ||u||_F (transposed when tall, R > C), then ``steps`` times
    X <- a X + (b A + c A^2) X with A = X X^T; transposed back."""
    a, b, c = NS
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _muon_reference_step(p, buf, g, lr, wd, mu, nesterov=True, adjust=True):
    """One Muon step in float64, as torch documents it (the buffer an EMA,
    B <- mu B + (1 - mu) g, as its source: proportional to the docstring's B <- mu B + g, which
    the Frobenius normalisation makes equivalent): (parameter, buffer) after the step."""
    p, g, buf = p.double(), g.double(), buf.double()
    rows, cols = p.shape
    scale = math.sqrt(max(1.0, rows / cols)) if adjust else 1.0
    buf = mu * buf + (1 - mu) * g
    u = (1 - mu) * g + mu * buf if nesterov else buf
    return p * (1 - lr * wd) - lr * scale * newton_schulz_reference(u), buf


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (32, 32)], ids=["tall", "wide", "square"])
def test_muon_update_equals_the_newton_schulz_reference(shape):
    """torch.optim.Muon with the settings lmlab gives it (Nesterov, weight decay, torch's
    "original" lr adjustment): the momentum buffer equals the reference to 1e-6; the
    parameter's change to 2% (Frobenius norm of the difference / of the update), the precision
    of torch's Newton-Schulz, which casts to bfloat16 on every device (2^-8 per operation over
    5 iterations; measured 1.5-1.9%). A reference
    without Nesterov momentum, or (tall matrices) without the sqrt(R / C) lr adjustment, is more
    than 5x further off from the second step on (the first step's Nesterov input is
    proportional to the gradient either way)."""
    torch.manual_seed(0)
    lr, wd, mu = 0.02, 0.1, 0.95
    p = torch.nn.Parameter(torch.randn(shape))
    opt = torch.optim.Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=True)
    buf = torch.zeros(shape, dtype=torch.float64)
    for step in range(3):
        g = torch.randn(shape)
        before = p.detach().clone()
        want, new_buf = _muon_reference_step(before, buf, g, lr, wd, mu)
        p.grad = g.clone()
        opt.step()
        got_buf = opt.state[p]["momentum_buffer"].double()
        torch.testing.assert_close(got_buf, new_buf, rtol=0, atol=1e-6)
        err = (p.detach().double() - want).norm().item()
        update = (before.double() * (1 - lr * wd) - want).norm().item()
        assert err < 0.02 * update
        if step > 0:
            plain, _ = _muon_reference_step(before, buf, g, lr, wd, mu, nesterov=False)
            assert (plain - want).norm().item() > 5 * err
            if shape[0] > shape[1]:
                flat, _ = _muon_reference_step(before, buf, g, lr, wd, mu, adjust=False)
                assert (flat - want).norm().item() > 5 * err
        buf = new_buf
        with torch.no_grad():  # the next step starts from the reference's parameters
            p.copy_(want.float())


def test_newton_schulz_reference_is_near_orthogonal():
    """The reference itself: the quintic leaves singular values in roughly [0.5, 1.5] (not all
    1, as Jordan et al. note), from a matrix whose singular values spread over 100x."""
    torch.manual_seed(1)
    u, _, v = torch.linalg.svd(torch.randn(16, 24, dtype=torch.float64), full_matrices=False)
    s = torch.logspace(-2, 0, 16, dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz_reference(u @ torch.diag(s) @ v))
    assert sv.min() > 0.5 and sv.max() < 1.5


def test_muon_holds_the_blocks_matrices_and_adamw_the_rest():
    cfg = tiny_config(train={"optimizer": "muon"})
    cfg.model.vocab_size = 50
    model = build_model(cfg.model)
    projections = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"]
    projections += ["ffn.up_proj", "ffn.down_proj"]
    expected = [f"layers.{i}.{p}.weight" for i in range(2) for p in projections]
    assert muon_param_names(model) == expected
    opt = build_optimizer(model, cfg.train)
    assert isinstance(opt, MuonWithAdamW)
    name_of = {id(p): n for n, p in model.named_parameters()}
    assert [name_of[id(p)] for p in opt.muon.param_groups[0]["params"]] == expected
    adamw = [name_of[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert "embed.weight" in adamw and "final_norm.weight" in adamw
    assert sorted(adamw + expected) == sorted(name_of.values())  # each parameter once
    group = opt.muon.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.95, 0.01, True)


def test_muon_leaves_an_untied_head_and_the_moe_router_to_adamw_and_takes_each_expert():
    cfg = tiny_config(
        model={
            "tie_embeddings": False,
            "ffn": {"kind": "moe", "n_experts": 2, "top_k": 1, "d_ff": 16},
        },
        train={"optimizer": "muon"},
    )
    cfg.model.vocab_size = 50
    names = muon_param_names(build_model(cfg.model))
    assert not any("router" in n or "lm_head" in n or "embed" in n for n in names)
    assert "layers.0.ffn.experts.1.down_proj.weight" in names
    assert all(n.endswith("_proj.weight") for n in names)


@pytest.mark.parametrize("kind", ["encoder", "encoder_decoder"])
def test_muon_takes_every_layer_matrix_of_encoders_and_encoder_decoders(kind):
    """Encoder blocks and an encoder-decoder's decoder blocks (self- and cross-attention) are
    Muon's; the embeddings and an encoder's pooler and MLM head transform stay with AdamW."""
    cfg = ModelConfig(kind=kind, d_model=32, n_layers=2, max_seq_len=32, vocab_size=50)
    cfg.attention.n_heads = 4
    if kind == "encoder":
        cfg.attention.mask = "bidirectional"
    model = build_model(cfg)
    names = muon_param_names(model)
    matrices = [n for n, p in model.named_parameters() if p.ndim == 2]
    left = {"encoder": ["embed.weight", "token_type.weight", "pooler.weight", "mlm_dense.weight"]}
    assert [n for n in matrices if n not in names] == left.get(kind, ["embed.weight"])
    assert len(names) == (12 if kind == "encoder" else 12 + 20)
    if kind == "encoder_decoder":
        assert "decoder.layers.1.cross_attn.k_proj.weight" in names


def test_schedule_factor_scales_muon_lr_and_adamw_lr_alike():
    cfg = tiny_config(train={"optimizer": "muon", "max_steps": 10, "muon_lr": 0.05})
    cfg.model.vocab_size = 50
    opt = build_optimizer(build_model(cfg.model), cfg.train)
    for step in (0, 2, 5, 9):
        lr = set_lr(opt, step, cfg.train)
        assert opt.adamw.param_groups[0]["lr"] == lr == lr_at(step, cfg.train)
        assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.05 * lr / cfg.train.lr, rel=1e-12)


def test_default_optimizer_and_schedule_are_unchanged():
    cfg = tiny_config()
    cfg.model.vocab_size = 50
    assert cfg.train.optimizer == "adamw" and cfg.train.schedule == "cosine"
    opt = build_optimizer(build_model(cfg.model), cfg.train)
    assert type(opt) is AdamW and isinstance(opt, torch.optim.AdamW)  # torch's, one-call step


# ---------------------------------------------------------------- the WSD schedule by hand


def test_wsd_schedule_by_hand_linear():
    """max_steps 10, warmup 2, decay_fraction 0.3: steps 0-1 warm up, 2-6 hold lr, 7-9 decay
    linearly, reaching min_lr at step 9 exactly."""
    t = TrainConfig(max_steps=10, warmup_steps=2, lr=1.0, min_lr=0.1, schedule="wsd")
    t.decay_fraction = 0.3
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1]
    got = [lr_at(s, t) for s in range(10)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[-1] == 0.1 and lr_at(12, t) == 0.1  # an extended run stays at min_lr


def test_wsd_schedule_by_hand_sqrt():
    t = TrainConfig(max_steps=8, warmup_steps=0, lr=2.0, min_lr=0.0, schedule="wsd")
    t.decay_fraction, t.decay_shape = 0.5, "sqrt"
    decay = [2.0 * (1 - math.sqrt(k / 4)) for k in (1, 2, 3)]
    want = [2.0, 2.0, 2.0, 2.0, *decay, 0.0]
    assert [lr_at(s, t) for s in range(8)] == pytest.approx(want, abs=1e-15)


def test_wsd_decay_that_would_start_inside_the_warmup_starts_after_it():
    t = TrainConfig(max_steps=5, warmup_steps=3, lr=1.0, min_lr=0.0, schedule="wsd")
    t.decay_fraction = 1.0
    assert [lr_at(s, t) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5, 0.0])


# ---------------------------------------------------------------- config fields


@pytest.mark.parametrize(
    "setting, needles",
    [
        ("train.optimizer=sgd", ("train.optimizer", "'sgd'", "adamw, muon")),
        ("train.schedule=linear", ("train.schedule", "cosine, wsd")),
        ("train.decay_shape=cubic", ("train.decay_shape", "linear, sqrt")),
        ("train.decay_fraction=1.5", ("train.decay_fraction",)),
        ("train.muon_momentum=1.0", ("train.muon_momentum",)),
    ],
)
def test_bad_optimizer_fields_are_one_config_error(capsys, tmp_path, setting, needles):
    code, _, err = run_cli(capsys, "train", "--out", str(tmp_path / "r"), "--set", setting)
    assert_one_error(code, err, *needles)


def test_muon_with_fsdp_is_refused():
    with pytest.raises(ConfigError, match="train.optimizer=muon .*train.parallel=fsdp"):
        tiny_config(train={"optimizer": "muon", "parallel": "fsdp"})


def test_memory_estimate_counts_one_muon_buffer_per_muon_parameter():
    adamw = tiny_config()
    muon = tiny_config(train={"optimizer": "muon"})
    for c in (adamw, muon):
        c.model.vocab_size = 50
    p = sum(x.numel() for x in build_model(adamw.model).parameters())
    model = build_model(muon.model)
    params = dict(model.named_parameters())
    p_muon = sum(params[n].numel() for n in muon_param_names(model))
    assert estimate_training_memory(adamw).optimizer == 8 * p
    assert estimate_training_memory(muon).optimizer == 4 * p_muon + 8 * (p - p_muon)


# ---------------------------------------------------------------- a run: train, save, resume


def _muon_run(max_steps: int, **train: object):
    return tiny_config(
        train={"optimizer": "muon", "schedule": "wsd", "max_steps": max_steps, **train}
    )


def _records(run: Path) -> list[dict]:
    keep = ("step", "lr", "train_loss", "val_loss", "grad_norm")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, lines)]


def test_a_muon_run_trains_checkpoints_and_resumes_identically(tmp_path):
    from lmlab.training.trainer import train

    full = train(_muon_run(4, lr_decay_steps=4), out=tmp_path / "full", progress=False)
    records = _records(tmp_path / "full")
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    ckpt = ck.latest_checkpoint(tmp_path / "full")
    saved = load_file(ckpt / ck.OPTIMIZER_FILE)
    assert "layers.0.attn.q_proj.weight::momentum_buffer" in saved
    assert "layers.0.attn.q_proj.weight::exp_avg" not in saved
    assert "embed.weight::exp_avg_sq" in saved
    # the state read back into a fresh optimizer is the state that was saved
    cfg = _muon_run(4)
    cfg.model.vocab_size = full_vocab(tmp_path / "full")
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.train)
    ck.load_checkpoint(ckpt, model, opt)
    again = ck.optimizer_tensors(opt, model)
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
    # 2 steps, then resumed to 4 == 4 in one go
    train(_muon_run(2, lr_decay_steps=4), out=tmp_path / "half", progress=False)
    resumed = train(resume=tmp_path / "half", max_steps=4, progress=False)
    assert resumed.train_loss == full.train_loss and resumed.val_loss == full.val_loss
    half = _records(tmp_path / "half")
    assert [r for r in half if "train_loss" in r] == [r for r in records if "train_loss" in r]
    assert half[-1] == records[-1]  # the final evaluation


def full_vocab(run: Path) -> int:
    return int(load_file(ck.latest_checkpoint(run) / ck.MODEL_FILE)["embed.weight"].shape[0])


def _assert_each_state_refused(capsys, run: Path, path: Path, cases: list) -> None:
    """Write each (tensors, needle) optimizer state to ``path``: resuming ``run`` gives one
    error naming the file and ``needle``, and leaves the run folder as it was."""
    for tensors, needle in cases:
        save_file(tensors, str(path))
        before = snapshot(run)
        code, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "4")
        assert_one_error(code, err, f"optimizer state {path}", needle)
        assert snapshot(run) == before


def test_muon_state_of_the_wrong_key_or_shape_is_refused(tmp_path, capsys):
    """A crafted optimizer.safetensors: an AdamW key on a Muon parameter (added, or in place of
    its buffer) or a buffer of another shape is one error naming the file and the tensor, and
    the run folder is left as it was."""
    from lmlab.training.trainer import train

    run = tmp_path / "r"
    train(_muon_run(2, lr_decay_steps=4), out=run, progress=False)
    path = ck.latest_checkpoint(run) / ck.OPTIMIZER_FILE
    good = load_file(path)
    key = "layers.0.attn.q_proj.weight"
    buf = good[f"{key}::momentum_buffer"]
    swapped = {k: v for k, v in good.items() if k != f"{key}::momentum_buffer"}
    cases = [
        ({**good, f"{key}::exp_avg": torch.zeros(32, 32)}, "'exp_avg' is not Muon state"),
        ({**swapped, f"{key}::exp_avg": buf.clone()}, "'exp_avg' is not Muon state"),
        (
            {**good, f"{key}::momentum_buffer": torch.zeros(3)},
            f"{key}::momentum_buffer of shape (3,)",
        ),
        ({**good, "embed.weight::momentum_buffer": torch.zeros(3)}, "is not AdamW state"),
    ]
    _assert_each_state_refused(capsys, run, path, cases)


def test_resuming_with_another_optimizer_is_refused(tmp_path):
    from lmlab.errors import LmlabError
    from lmlab.training.trainer import train

    train(_muon_run(2, lr_decay_steps=4), out=tmp_path / "r", progress=False)
    other = _muon_run(2, lr_decay_steps=4)
    other.train.optimizer = "adamw"
    with pytest.raises(LmlabError, match="train.optimizer"):
        train(other, resume=tmp_path / "r", max_steps=4, progress=False)


def test_muon_gets_its_own_lr_momentum_and_weight_decay():
    cfg = tiny_config(
        train={"optimizer": "muon", "muon_lr": 0.03, "muon_momentum": 0.9, "muon_weight_decay": 0.2}
    )
    cfg.model.vocab_size = 50
    opt = build_optimizer(build_model(cfg.model), cfg.train)
    group = opt.muon.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.03, 0.9, 0.2)
    assert group["ns_steps"] == 5 and group["ns_coefficients"] == NS
    assert group["adjust_lr_fn"] is None  # torch's "original": sqrt(max(1, rows / cols))
    assert [g["weight_decay"] for g in opt.adamw.param_groups] == [cfg.train.weight_decay, 0.0]


def test_muon_with_adamw_state_dict_round_trips_into_a_fresh_optimizer():
    """After a step, state_dict -> load_state_dict into a new optimizer of the same model gives
    equal state, and both then take the same next step."""
    cfg = tiny_config(train={"optimizer": "muon"})
    cfg.model.vocab_size = 50
    torch.manual_seed(0)
    model = build_model(cfg.model)
    twin = build_model(cfg.model)
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (2, 8))

    def step(m, opt):
        m(ids, targets=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    opt = build_optimizer(model, cfg.train)
    step(model, opt)
    twin.load_state_dict(model.state_dict())
    other = build_optimizer(twin, cfg.train)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load keeps the tensors
    a, b = opt.state_dict()["state"], other.state_dict()["state"]
    assert a.keys() == b.keys() and len(a) == len(list(model.parameters()))
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    assert len(other.state) == len(a)  # the merged view
    step(model, opt)
    step(twin, other)
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    "fraction, want", [(0.0, [1.0, 1.0, 1.0, 0.0]), (1.0, [1.0, 2 / 3, 1 / 3, 0.0])]
)
def test_wsd_decay_fraction_ends_are_accepted(fraction, want):
    """0: only the last step is at min_lr; 1: the whole run after the warmup decays."""
    cfg = tiny_config(train={"schedule": "wsd", "decay_fraction": fraction, "max_steps": 4})
    t = cfg.train
    t.lr, t.min_lr, t.warmup_steps = 1.0, 0.0, 0
    assert [lr_at(s, t) for s in range(4)] == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_of_impossible_values_is_refused(tmp_path, capsys, optimizer):
    """A crafted optimizer.safetensors whose values no optimizer holds (a negative or huge
    second moment, a first moment or momentum buffer of 3e38, a step of 1e30, 0.5 or beyond
    the checkpoint's step 2, a parameter's keys partly missing, a Muon parameter's buffer
    wholly missing) is one error naming the file and the tensor, before any step is taken:
    the run folder is left as it was (not a later "non-finite weights; lower train.lr")."""
    from lmlab.training.trainer import train

    run = tmp_path / "r"
    train(_muon_run(2, lr_decay_steps=4, optimizer=optimizer), out=run, progress=False)
    path = ck.latest_checkpoint(run) / ck.OPTIMIZER_FILE
    good = load_file(path)

    def every(suffix, value):
        return {
            k: (torch.full_like(v, value) if k.endswith(suffix) else v) for k, v in good.items()
        }

    emb = "embed.weight"
    cases = [
        (every("::exp_avg_sq", -1.0), "::exp_avg_sq"),
        (every("::exp_avg_sq", 1e31), "::exp_avg_sq"),
        (every("::exp_avg", 3e38), "::exp_avg "),
        ({**good, f"{emb}::step": torch.tensor(1e30)}, f"{emb}::step"),
        ({**good, f"{emb}::step": torch.tensor(0.5)}, f"{emb}::step"),
        ({**good, f"{emb}::step": torch.tensor(3.0)}, f"{emb}::step = 3"),
        ({k: v for k, v in good.items() if k != f"{emb}::exp_avg_sq"}, f"lacks {emb}::exp_avg_sq"),
    ]
    if optimizer == "muon":
        q = "layers.0.attn.q_proj.weight::momentum_buffer"
        cases += [
            (every("::momentum_buffer", 3e38), "::momentum_buffer"),
            ({k: v for k, v in good.items() if k != q}, f"lacks {q}"),
        ]
    _assert_each_state_refused(capsys, run, path, cases)
    save_file(good, str(path))  # the untouched state still resumes
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--max-steps", "3")
    assert code == 0, err


@pytest.mark.parametrize(
    "setting, selector",
    [
        ("train.muon_lr=0.05", "optimizer=muon only, not adamw"),
        ("train.muon_momentum=0.9", "optimizer=muon only, not adamw"),
        ("train.muon_weight_decay=0.1", "optimizer=muon only, not adamw"),
        ("train.decay_fraction=0.5", "schedule=wsd only, not cosine"),
        ("train.decay_shape=sqrt", "schedule=wsd only, not cosine"),
    ],
)
def test_muon_and_wsd_fields_off_their_optimizer_or_schedule_are_refused(
    capsys, tmp_path, setting, selector
):
    """A Muon field under train.optimizer: adamw, or a WSD field under train.schedule: cosine,
    has no effect: one error naming the field (as the generic option rule words it), and no
    run folder is made."""
    field, _, value = setting.partition("=")
    out = tmp_path / "r"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--set", setting)
    assert_one_error(code, err, f"{field} applies to {selector}", "has no effect", value)
    assert not out.exists()


def test_muon_and_wsd_fields_at_their_defaults_or_with_their_owner_are_accepted():
    tiny_config(train={"optimizer": "adamw", "muon_lr": 0.02, "decay_shape": "linear"})
    tiny_config(train={"optimizer": "muon", "muon_lr": 0.05, "muon_weight_decay": 0.0})
    tiny_config(train={"schedule": "wsd", "decay_fraction": 0.5, "decay_shape": "sqrt"})


def test_grouped_muon_equals_torch_muon_and_the_reference():
    """lmlab's GroupedMuon (the matrices of one shape orthogonalised in one batch) against
    torch.optim.Muon one matrix at a time, three steps from the same parameters and gradients,
    with Nesterov momentum, weight decay and tall, wide and square matrices (two of each): the
    momentum buffers are equal to 1e-6 and the parameters' changes within 1% of the update
    (bfloat16 rounding: batched and single matmuls may sum in another order); each parameter's
    change is within 2% of the float64 reference, as torch's is."""
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 24), (32, 32), (24, 16), (32, 32), (16, 24)]
    lr, wd, mu = 0.02, 0.1, 0.95
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = {"lr": lr, "weight_decay": wd, "momentum": mu, "nesterov": True}
    opt_ours, opt_theirs = GroupedMuon(ours, **kw), torch.optim.Muon(theirs, **kw)
    bufs = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        before = [p.detach().clone() for p in ours]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        for i, (p, q, g) in enumerate(zip(ours, theirs, grads, strict=True)):
            torch.testing.assert_close(
                opt_ours.state[p]["momentum_buffer"],
                opt_theirs.state[q]["momentum_buffer"],
                rtol=0,
                atol=1e-6,
            )
            want, bufs[i] = _muon_reference_step(before[i], bufs[i], g, lr, wd, mu)
            update = (before[i].double() * (1 - lr * wd) - want).norm().item()
            assert (p.detach() - q.detach()).double().norm().item() < 0.01 * update
            assert (p.detach().double() - want).norm().item() < 0.02 * update
        with torch.no_grad():  # both continue from the same parameters
            for p, q in zip(ours, theirs, strict=True):
                q.copy_(p)


def test_muon_option_builds_the_grouped_muon():
    cfg = tiny_config(train={"optimizer": "muon"})
    cfg.model.vocab_size = 40
    opt = build_optimizer(build_model(cfg.model), cfg.train)
    assert type(opt.muon) is GroupedMuon


def test_grouped_muon_newton_schulz_in_float32_is_the_same_iteration_rounded_less():
    """ns_dtype float32 (a CPU without bf16 units) runs the same iteration: its update is
    within 1e-4 of the float64 reference (bfloat16's is only within 2%), and it is within
    bfloat16's 2% of the bfloat16 update."""
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 24), (32, 32)]
    lr, wd, mu = 0.02, 0.1, 0.95
    kw = {"lr": lr, "weight_decay": wd, "momentum": mu, "nesterov": True}
    p32 = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    p16 = [torch.nn.Parameter(p.detach().clone()) for p in p32]
    before = [p.detach().clone() for p in p32]
    opt32 = GroupedMuon(p32, ns_dtype=torch.float32, **kw)
    opt16 = GroupedMuon(p16, **kw)
    grads = [torch.randn(s) for s in shapes]
    for p, q, g in zip(p32, p16, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt32.step()
    opt16.step()
    for i, g in enumerate(grads):
        want, _ = _muon_reference_step(
            before[i], torch.zeros(shapes[i], dtype=torch.float64), g, lr, wd, mu
        )
        update = (before[i].double() * (1 - lr * wd) - want).norm().item()
        assert (p32[i].detach().double() - want).norm().item() < 1e-4 * update
        assert (p16[i].detach().double() - want).norm().item() > 1e-3 * update  # bf16 rounds
        assert (p32[i] - p16[i]).detach().double().norm().item() < 0.02 * update
    with pytest.raises(ValueError, match="ns_dtype"):
        GroupedMuon(p32, ns_dtype=torch.float16, **kw)


def test_muon_newton_schulz_dtype_follows_the_device_bf16_units(monkeypatch):
    """build_optimizer: bfloat16 Newton-Schulz where the device has fast bf16, float32 where
    bf16 matmuls would be emulated (the reason the speedrun on an AVX2-only EPYC took 3.9 s a
    step with torch.optim.Muon)."""
    from lmlab.training import optim

    cfg = tiny_config(train={"optimizer": "muon"})
    cfg.model.vocab_size = 40
    model = build_model(cfg.model)
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(optim, "has_fast_bf16", lambda device, fast=fast: fast)
        assert build_optimizer(model, cfg.train).muon.ns_dtype is want
