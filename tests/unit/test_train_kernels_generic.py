"""The training kernels' scalar code (the build without instruction-set flags, which CPUs
without AVX-512 run; on AVX-512 builds the masked vector tails leave it unused): the one-pass
operators against their float64 formulas, and bit for bit against the vector build where this
CPU has one. The generic library registers the same torch operators, so it is loaded in a child
process."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from lmlab.envflags import opted_out
from lmlab.nn import cpp_build, train_kernel

COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

CHILD = textwrap.dedent(
    """
    import sys, torch
    import lmlab.nn.train_kernel as tk
    if sys.argv[2] == "generic":
        tk._build_kind = lambda: "generic"
    assert tk.available(), tk.status()
    torch.manual_seed(0)
    o = torch.ops.lmlab
    gate = (torch.randn(5, 333) * 4).bfloat16().requires_grad_()
    up = torch.randn(5, 333).bfloat16().requires_grad_()
    g = torch.randn(5, 333).bfloat16()
    h = o.silu_mul_bf16(gate, up)
    h.backward(g)
    x = torch.randn(7, 37, requires_grad=True)
    y = torch.randn(7, 37).bfloat16().requires_grad_()
    b = torch.randn(37, requires_grad=True)
    s = o.add_f32_bf16(x, y, b)
    gs = torch.randn(7, 37)
    s.backward(gs)
    u = (torch.randn(70, 37) * 3).bfloat16().requires_grad_()
    ub = torch.randn(37, requires_grad=True)
    a = o.gelu_bf16(u, ub, False)
    ga = torch.randn(70, 37).bfloat16()
    a.backward(ga)
    sizes = [5, 16, 37, 2590]
    ps = [torch.randn(n) for n in sizes]
    gs_ = [torch.randn(n) * 1e-2 for n in sizes]
    ms = [torch.randn(n) * 1e-2 for n in sizes]
    vs = [torch.rand(n) * 1e-4 for n in sizes]
    adam_in = [[t.clone() for t in ts] for ts in (ps, gs_, ms, vs)]
    steps = [torch.tensor(6.0) for _ in sizes]
    k = len(sizes)
    assert o.adamw_step_(ps, gs_, ms, vs, steps, [3e-3] * k, [0.9] * k, [0.95] * k,
                         [0.1, 0.0, 0.1, 0.1], [1e-8] * k)
    torch.save({
        "adamw_in": adam_in,
        "adamw": (ps, ms, vs, steps),
        "in": (gate.detach(), up.detach(), g, x.detach(), y.detach(), b.detach(), u.detach(),
               ub.detach()),
        "silu": (h.detach(), gate.grad, up.grad),
        "add": (s.detach(), y.grad, b.grad, gs),
        "gelu": (a.detach(), u.grad, ub.grad, ga),
    }, sys.argv[1])
    """
)


def _child(tmp_path, kind: str) -> dict:
    out = tmp_path / f"{kind}.pt"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), kind], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(out)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    ref = ref.double()
    return bool(((got.double() - ref).abs() <= rel * ref.abs() + 1e-12 * ref.abs().max()).all())


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
@pytest.mark.skipif(opted_out(cpp_build.ENV_OFF), reason=f"{cpp_build.ENV_OFF} is set")
def test_the_scalar_build_computes_the_operators_formulas(tmp_path):
    res = _child(tmp_path, "generic")
    gate, up, g, x, y, b, u, ub = res["in"]
    # silu(gate) * up and its gradients: the float64 formula, rounded once
    z, w, gd = gate.double(), up.double(), g.double()
    sig = torch.sigmoid(z)
    h, dgate, dup = res["silu"]
    assert _close(h, z * sig * w, 2.0**-8 + 1e-5)
    assert _close(dup, gd * z * sig, 2.0**-8 + 1e-5)
    slack = 1e-5 * gd.abs() * w.abs() * (1 + z.abs())
    assert ((dgate.double() - gd * w * sig * (1 + z * (1 - sig))).abs() <= (
        2.0**-8 * (gd * w * sig * (1 + z * (1 - sig))).abs() + slack)).all()  # fmt: skip
    # x + (y + b): the float32 formula exactly; the branch's gradient g rounded, the bias's
    # g's column sums (float64 to float32 rounding)
    s, dy, db, gs = res["add"]
    assert torch.equal(s, x + (y.float() + b))
    assert torch.equal(dy, gs.bfloat16())
    assert torch.allclose(db.double(), gs.double().sum(0), rtol=1e-6, atol=1e-6)
    # gelu(u + ub): the float64 formula to one rounding (std::erf in the scalar build), within
    # 1e-6 (1 + |z|) where gelu is tiny; its bias gradient the column sums of the float32
    # gradient before its rounding: the float64 formula's, within its error and the float32 sum's
    a, du, dub, ga = res["gelu"]
    zz = u.double() + ub.double()
    cdf = 0.5 * (1 + torch.erf(zz / 2**0.5))
    ref = zz * cdf
    assert ((a.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * (1 + zz.abs())).all()
    terms = ga.double() * (cdf + zz * torch.exp(-0.5 * zz * zz) / (2 * math.pi) ** 0.5)
    slack = (1e-6 * ga.double().abs() * (1 + zz.abs()) + 1e-6 * terms.abs()).sum(0)
    assert ((dub.double() - terms.sum(0)).abs() <= slack).all()
    assert not torch.equal(dub, du.float().sum(0))  # not the sum of the rounded gradient
    # AdamW (step 7): the float64 formula, within a few float32 roundings of its terms
    (p0s, g0s, m0s, v0s), (ps, ms, vs, steps) = res["adamw_in"], res["adamw"]
    lr, b1, b2, eps, t = 3e-3, 0.9, 0.95, 1e-8, 7
    for i, wd in enumerate([0.1, 0.0, 0.1, 0.1]):
        assert steps[i].item() == t
        p0, g0, m0, v0 = (z[i].double() for z in (p0s, g0s, m0s, v0s))
        m_ref, m_scale = b1 * m0 + (1 - b1) * g0, b1 * m0.abs() + (1 - b1) * g0.abs()
        v_ref = b2 * v0 + (1 - b2) * g0 * g0
        update = lr / (1 - b1**t) * m_ref / (v_ref.sqrt() / (1 - b2**t) ** 0.5 + eps)
        p_ref, p_scale = p0 * (1 - lr * wd) - update, p0.abs() + update.abs()
        for got, ref, scale in (
            (ms[i], m_ref, m_scale),
            (vs[i], v_ref, v_ref),
            (ps[i], p_ref, p_scale),
        ):
            assert ((got.double() - ref).abs() <= 4 * 2.0**-24 * scale).all()


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
@pytest.mark.skipif(opted_out(cpp_build.ENV_OFF), reason=f"{cpp_build.ENV_OFF} is set")
@pytest.mark.skipif(
    train_kernel._build_kind() == "generic", reason="this CPU has no AVX-512 build to compare"
)
def test_the_scalar_and_vector_builds_agree_bit_for_bit(tmp_path):
    scalar, vector = _child(tmp_path, "generic"), _child(tmp_path, "native")
    for op in ("silu", "add"):  # the same formulas in the same order (no subnormal results here)
        for a, b in zip(scalar[op], vector[op], strict=True):
            assert torch.equal(a, b), op
    for a, b in zip(scalar["adamw"], vector["adamw"], strict=True):  # lists of tensors
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "adamw"
    for a, b in zip(scalar["gelu"], vector["gelu"], strict=True):  # std::erf vs A&S 7.1.26
        diff = (a.double() - b.double()).abs()
        assert (diff <= 2.0**-7 * b.double().abs() + 1e-5 * b.double().abs().max()).all()
