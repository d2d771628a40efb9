"""lmlab's one-call AdamW step (lmlab.training.optim.AdamW, torch.ops.lmlab.adamw_step_):
torch's AdamW(fused=True) bit for bit where torch runs its AVX-512 kernel, the float64 formula
otherwise, the same state and hooks, and torch's own step wherever the kernel does not apply."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import lmlab.training.optim as optim
from lmlab.nn import train_kernel

pytestmark = pytest.mark.skipif(not train_kernel.available(), reason="no C++ training kernels")

# torch's fused kernel and lmlab's round the same operations only where both run sixteen lanes
# (torch's AVX512 capability and lmlab's AVX-512 build): elsewhere a tensor's last few elements
# may differ by one rounding of the second moment
SAME_BITS = torch.backends.cpu.get_cpu_capability() == "AVX512" and (
    train_kernel._build_kind() != "generic"
)
SIZES = [(1,), (15,), (16,), (17,), (3, 11), (33,), (64, 70), (4103,), (0,), (257, 129)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SIZES]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10.0 ** (step % 3 - 2) for p in params]


def _groups(params, beta1=0.9):
    half = len(params) // 2
    return [
        {"params": params[:half], "weight_decay": 0.1},
        {"params": params[half:], "weight_decay": 0.0, "betas": (beta1, 0.95), "lr": 2e-3},
    ]


def _run(cls, steps: int = 4, beta1: float = 0.9, kernel: bool = True, **kw):
    """Both optimizers over the same parameters and gradients; lr changed between steps as a
    schedule does. Returns (params, optimizer)."""
    params = _params()
    opt = cls(_groups(params, beta1), lr=3e-3, betas=(beta1, 0.99), eps=1e-8, fused=True, **kw)
    old = optim.ADAMW_KERNEL
    optim.ADAMW_KERNEL = kernel
    try:
        for step in range(steps):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.9
            opt.step()
    finally:
        optim.ADAMW_KERNEL = old
    return params, opt


def _assert_state_equal(a, pa, b, pb, exact: bool) -> None:
    for x, y in zip(pa, pb, strict=True):
        sa, sb = a.state[x], b.state[y]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert sa["step"].dtype == sb["step"].dtype == torch.float32
        assert torch.equal(sa["step"], sb["step"])
        for got, ref in (
            (x, y),
            (sa["exp_avg"], sb["exp_avg"]),
            (sa["exp_avg_sq"], sb["exp_avg_sq"]),
        ):
            if exact:
                assert torch.equal(got.detach(), ref.detach())
            else:
                torch.testing.assert_close(got.detach(), ref.detach(), rtol=2e-6, atol=1e-12)


def _fallback_count(monkeypatch) -> list[int]:
    """Count the steps that went to torch's own AdamW step."""
    calls: list[int] = []
    torch_step = optim._torch_adamw_step

    def counted(opt, closure):
        calls.append(1)
        return torch_step(opt, closure)

    monkeypatch.setattr(optim, "_torch_adamw_step", counted)
    return calls


# the lerp from m (1 - beta1 < 0.5), from g (1 - beta1 >= 0.5: 0.5 exactly included), beta1 = 0
@pytest.mark.parametrize("beta1", [0.9, 0.3, 0.5, 0.0])
def test_the_kernel_steps_as_torch_fused_adamw(beta1, monkeypatch):
    calls = _fallback_count(monkeypatch)
    ours, opt = _run(optim.AdamW, beta1=beta1)
    assert len(calls) == 1  # the first step creates the state: torch's; the other three the kernel
    ref, ref_opt = _run(torch.optim.AdamW, beta1=beta1)
    _assert_state_equal(opt, ours, ref_opt, ref, exact=SAME_BITS)
    assert not torch.equal(ours[0].detach(), _params()[0].detach())  # it did step


def test_the_kernel_matches_the_float64_formula():
    """One step from a given state against AdamW written out in float64 (Loshchilov & Hutter
    2019, with torch's bias corrections)."""
    torch.manual_seed(3)
    n = 4103
    p0, g = torch.randn(n), torch.randn(n) * 1e-2
    m0, v0 = torch.randn(n) * 1e-2, torch.rand(n) * 1e-4
    lr, b1, b2, wd, eps, t = 3e-3, 0.9, 0.95, 0.1, 1e-8, 7
    p, m, v, step = p0.clone(), m0.clone(), v0.clone(), torch.tensor(float(t - 1))
    args = ([p], [g], [m], [v], [step], [lr], [b1], [b2], [wd], [eps])
    assert torch.ops.lmlab.adamw_step_(*args)
    assert step.item() == t
    P, G, M, V = (x.double() for x in (p0, g, m0, v0))
    # each result within a few float32 roundings of its terms' magnitudes (m's two terms cancel)
    M, m_scale = b1 * M + (1 - b1) * G, b1 * M.abs() + (1 - b1) * G.abs()
    V = b2 * V + (1 - b2) * G * G
    den = V.sqrt() / math.sqrt(1 - b2**t) + eps
    update = lr / (1 - b1**t) * M / den
    P, p_scale = P * (1 - lr * wd) - update, P.abs() + update.abs()
    for got, ref, scale in ((m, M, m_scale), (v, V, V), (p, P, p_scale)):
        assert ((got.double() - ref).abs() <= 4 * 2.0**-24 * scale).all()


def test_the_same_bits_on_one_thread_and_two():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run(optim.AdamW)
        torch.set_num_threads(2)
        two, _ = _run(optim.AdamW)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_the_kernel_and_torch_paths_of_the_class_agree():
    on, opt_on = _run(optim.AdamW, kernel=True)
    off, opt_off = _run(optim.AdamW, kernel=False)
    _assert_state_equal(opt_on, on, opt_off, off, exact=SAME_BITS)


def test_a_checkpoint_moves_between_lmlab_and_torch_adamw():
    ours, opt = _run(optim.AdamW, steps=3)
    params = [nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = torch.optim.AdamW(_groups(params), lr=3e-3, betas=(0.9, 0.99), fused=True)
    # deep copies: load_state_dict keeps a tensor that already has the parameter's dtype and
    # device, so the two optimizers would share (and both update) one state
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = optim.AdamW(_groups(ours), lr=3e-3, betas=(0.9, 0.99), fused=True)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for a, b, g in zip(ours, params, _grads(ours, 5), strict=True):
        a.grad, b.grad = g, g.clone()
    back.step()
    torch_opt.step()
    _assert_state_equal(back, ours, torch_opt, params, exact=SAME_BITS)


def test_parameters_without_a_gradient_are_left_alone():
    params = _params()
    opt = optim.AdamW(_groups(params), lr=1e-2, fused=True)
    for step in range(3):
        for i, (p, g) in enumerate(zip(params, _grads(params, step), strict=True)):
            p.grad = None if i == 2 and step > 0 else g
        opt.step()
    assert opt.state[params[2]]["step"].item() == 1
    assert opt.state[params[3]]["step"].item() == 3


def test_optimizer_hooks_run_once_a_step():
    params = _params()
    opt = optim.AdamW(params, lr=1e-2, fused=True)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    for step in range(3):  # the first torch's, then the kernel's
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert seen == ["pre", "post"] * 3


CANNOT = ["bf16", "overlap", "noncontiguous", "amsgrad", "maximize", "tensor_lr", "closure", "off"]
CANNOT += ["foreach", "unfused", "default", "grad_scaler"]


@pytest.mark.parametrize("case", CANNOT)
def test_what_the_kernel_cannot_take_is_stepped_by_torch(case, monkeypatch):
    """Each case steps through torch's own AdamW, with torch's results (for foreach, unfused
    and default groups: torch's arithmetic for that implementation, not the fused kernel's)."""
    torch.manual_seed(0)
    base, other = torch.randn(8, 6), torch.randn(5)

    def make() -> list[nn.Parameter]:  # new tensors for each run
        if case == "bf16":
            return [nn.Parameter(base.bfloat16()), nn.Parameter(other.clone())]
        if case == "overlap":  # two parameters viewing one buffer
            flat = base.clone().view(-1)
            return [nn.Parameter(flat[:30]), nn.Parameter(flat[20:])]
        if case == "noncontiguous":
            return [nn.Parameter(base.clone().t())]
        return [nn.Parameter(base.clone()), nn.Parameter(other.clone())]

    kw: dict = {"fused": True}
    if case in ("amsgrad", "maximize"):
        kw[case] = True
    kw.update(
        {"foreach": {"foreach": True, "fused": None}, "unfused": {"fused": False}}.get(case, {})
    )
    if case == "default":
        kw.pop("fused")
    lr = torch.tensor(1e-2) if case == "tensor_lr" else 1e-2

    def run(cls):
        params = make()
        opt = cls(params, lr=lr, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if case == "grad_scaler" else None
        for step in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (step + 1)) * (1024.0 if scaler else 1.0)
            if scaler is not None:
                scaler.scale(torch.ones(()))  # a loss scaled: the scaler's state begins
                scaler.step(opt)  # the fused step unscales by grad_scale, skips on found_inf
                scaler.update()
            else:
                opt.step((lambda: torch.tensor(0.0)) if case == "closure" else None)
        return params

    calls = _fallback_count(monkeypatch)
    old = optim.ADAMW_KERNEL
    optim.ADAMW_KERNEL = case != "off"
    try:
        ours = run(optim.AdamW)
    finally:
        optim.ADAMW_KERNEL = old
    assert len(calls) == 3
    for a, b in zip(ours, run(torch.optim.AdamW), strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_a_step_the_kernel_cannot_take_never_builds_the_kernels(monkeypatch):
    """bf16 parameters (and CUDA ones, FSDP2 shards): torch's step, without compiling lmlab's
    library on the way (it needs a compiler, and other ranks would wait for the build)."""
    asked = []
    monkeypatch.setattr(train_kernel, "available", lambda: asked.append(1) or True)
    params = [nn.Parameter(torch.randn(4, 4).bfloat16())]
    opt = optim.AdamW(params, lr=1e-2, fused=True)
    for _ in range(3):
        params[0].grad = torch.ones_like(params[0])
        opt.step()
    empty = optim.AdamW([nn.Parameter(torch.randn(3))], lr=1e-2, fused=True)
    empty.step()  # no gradients at all
    assert asked == []


def test_the_operator_refuses_without_writing():
    p, g, m, v, s = torch.ones(5), torch.ones(4), torch.zeros(5), torch.zeros(5), torch.zeros(())
    hyper = ([1e-3], [0.9], [0.99], [0.0], [1e-8])
    assert not torch.ops.lmlab.adamw_step_([p], [g], [m], [v], [s], *hyper)  # grad size
    assert not torch.ops.lmlab.adamw_step_([p], [torch.ones(5)], [m], [m], [s], *hyper)  # shared
    assert not torch.ops.lmlab.adamw_step_(
        [p], [torch.ones(5)], [m], [v], [s.double()], *hyper
    )  # a float64 step count
    shrunk = torch.ones(1 << 12)
    shrunk.untyped_storage().resize_(16)  # its sizes now reach past its storage
    big = [torch.zeros(1 << 12) for _ in range(3)]
    assert not torch.ops.lmlab.adamw_step_([shrunk], [big[0]], [big[1]], [big[2]], [s], *hyper)
    assert torch.equal(p, torch.ones(5)) and s.item() == 0 and not m.any()
    with pytest.raises(RuntimeError, match="one entry per parameter"):
        torch.ops.lmlab.adamw_step_([p], [g], [m], [v], [s], [1e-3, 1e-3], *hyper[1:])


def test_the_operator_counts_what_it_writes_in_versions():
    """As torch's in-place step: a graph that saved a parameter refuses its backward after the
    step instead of using the new values; an inference tensor is refused (no version)."""
    p = torch.ones(5, requires_grad=True)
    with torch.no_grad():
        g, m, v, s = torch.ones(5), torch.zeros(5), torch.zeros(5), torch.zeros(())
    x = torch.ones(5, requires_grad=True)
    y = (x * p).sum()  # saves p for x's gradient
    versions = [t._version for t in (p, m, v, s)]
    hyper = ([1e-3], [0.9], [0.99], [0.0], [1e-8])
    with torch.no_grad():
        assert torch.ops.lmlab.adamw_step_([p], [g], [m], [v], [s], *hyper)
    assert all(t._version > old for t, old in zip((p, m, v, s), versions, strict=True))
    assert g._version == 0  # read only
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with torch.inference_mode():
        q, gi = torch.ones(5), torch.ones(5)
    assert not torch.ops.lmlab.adamw_step_([q], [g], [m], [v], [s], *hyper)
    assert torch.equal(q, torch.ones(5))
    with torch.no_grad():  # an inference gradient is only read: taken
        assert torch.ops.lmlab.adamw_step_([p], [gi], [m], [v], [s], *hyper)


def test_the_trainer_builds_it_and_training_keeps_its_bits():
    """build_optimizer's AdamW is this class (Muon's AdamW part too); a few training steps of a
    tiny model with the kernel on and off end with the same parameters."""
    from lmlab.config import load_config
    from lmlab.models.build import build_model

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.vocab_size=40"])
    assert type(optim.build_optimizer(build_model(cfg.model), cfg.train)) is optim.AdamW
    cfg.train.optimizer = "muon"
    assert type(optim.build_optimizer(build_model(cfg.model), cfg.train).adamw) is optim.AdamW

    def train(kernel: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        cfg.train.optimizer = "adamw"
        opt = optim.build_optimizer(model, cfg.train)
        ids = torch.randint(0, 40, (4, 17))
        old = optim.ADAMW_KERNEL
        optim.ADAMW_KERNEL = kernel
        try:
            for _ in range(4):
                loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            optim.ADAMW_KERNEL = old
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    on, off = train(True), train(False)
    for k in on:
        if SAME_BITS:
            assert torch.equal(on[k], off[k]), k
        else:
            torch.testing.assert_close(on[k], off[k], rtol=1e-5, atol=1e-7)
