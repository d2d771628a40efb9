"""lmlab.nn.fused.dense: float32 CPU inference linears through oneDNN compute F.linear's product,
and every case the fast path must not take goes to F.linear."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lmlab.models.decoder import DecoderLM
from lmlab.nn import fused
from lmlab.nn.fused import dense
from tests.helpers import tiny_model_config

pytestmark = pytest.mark.skipif(
    fused._onednn() is None, reason="this torch has no oneDNN linear (F.linear everywhere)"
)


class Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class DispatchPassthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class Spy:
    """Stands in for torch.ops.mkldnn._linear_pointwise: counts calls, forwards to the op."""

    def __init__(self) -> None:
        self.real = fused._onednn()
        self.calls = 0

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.real(*args)  # type: ignore[operator]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    s = Spy()
    monkeypatch.setattr(fused, "_onednn_op", s)
    monkeypatch.setattr(fused, "ONEDNN", True)
    monkeypatch.setattr(fused, "ONEDNN_MIN_MACS", 0)  # these tests' products are small
    return s


def test_small_products_stay_with_f_linear(spy: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ONEDNN_MIN_MACS multiply-adds (rows x N x K) oneDNN's call overhead outweighs it."""
    monkeypatch.setattr(fused, "ONEDNN_MIN_MACS", 1 << 22)
    w = torch.randn(512, 256)
    with torch.no_grad():
        dense(torch.randn(31, 256), w, None)  # 31 x 512 x 256 < 2^22
        assert spy.calls == 0
        dense(torch.randn(2, 16, 256), w, None)  # 32 x 512 x 256 = 2^22
        assert spy.calls == 1


def _case(
    m: int, k: int, n: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(2, m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x, w, torch.randn(n, generator=g) if bias else None


@pytest.mark.parametrize("m", [1, 3, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_equals_f_linear_through_onednn(spy: Spy, m: int, bias: bool) -> None:
    x, w, b = _case(m, 96, 160, bias)
    with torch.no_grad():
        got = dense(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert spy.calls == 1
    assert got.shape == (2, m, 160) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_dense_reads_a_non_contiguous_input_and_a_parameter(spy: Spy) -> None:
    lin = nn.Linear(64, 48)
    x = torch.randn(40, 3, 64).transpose(0, 1)  # (3, 40, 64), not contiguous
    with torch.inference_mode():
        got = dense(x, lin.weight, lin.bias)
    assert spy.calls == 1
    torch.testing.assert_close(
        got, F.linear(x, lin.weight, lin.bias).detach(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "case",
    [
        "grad enabled",
        "bf16",
        "autocast",
        "weight transposed",
        "one-dim x",
        "empty x",
        "flag off",
        "torch function mode",
        "dispatch mode",
        "bias of another dtype",
        "strided bias",
    ],
)
def test_dense_leaves_every_other_case_to_f_linear(spy: Spy, case: str) -> None:
    x, w, b = _case(4, 32, 16, True)
    ctx: object = torch.no_grad()
    if case == "grad enabled":
        ctx = torch.enable_grad()
        w.requires_grad_(True)
    elif case == "bf16":
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()  # type: ignore[union-attr]
    elif case == "weight transposed":
        w = torch.randn(32, 16).t()
    elif case == "one-dim x":
        x = x[0, 0]
    elif case == "empty x":
        x = x[:, :0]
    elif case == "bias of another dtype":
        b = b.double()  # type: ignore[union-attr]
    elif case == "strided bias":  # oneDNN would read it as dense: wrong sums, not an error
        b = torch.randn(32)[::2]
    with ctx:  # type: ignore[attr-defined]
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = dense(x, w, b), F.linear(x, w, b)
        elif case == "flag off":
            fused.ONEDNN = False
            got, want = dense(x, w, b), F.linear(x, w, b)
        elif case == "torch function mode":
            with Passthrough():
                got, want = dense(x, w, b), F.linear(x, w, b)
        elif case == "dispatch mode":
            with DispatchPassthrough():
                got, want = dense(x, w, b), F.linear(x, w, b)
        elif case == "bias of another dtype":
            with pytest.raises(RuntimeError) as err:
                dense(x, w, b)
            with pytest.raises(RuntimeError) as ref:
                F.linear(x, w, b)
            assert str(err.value) == str(ref.value)  # F.linear's own error
            got = want = torch.zeros(())
        else:
            got, want = dense(x, w, b), F.linear(x, w, b)
    assert spy.calls == 0
    assert got.dtype == want.dtype and torch.equal(got, want)
    if case == "grad enabled":
        got.sum().backward()  # a product autograd can differentiate
        assert w.grad is not None


@pytest.mark.parametrize(
    "layout",
    ["last dim stride 2", "expanded (stride 0)", "4-D", "permuted 5-D", "sliced rows", "offset"],
)
def test_dense_reads_any_input_layout(spy: Spy, layout: str) -> None:
    """oneDNN gets x as torch hands it over: every strided layout gives F.linear's product."""
    k, n = 64, 48
    w, b = torch.randn(n, k), torch.randn(n)
    x = {
        "last dim stride 2": lambda: torch.randn(3, 10, 2 * k)[..., ::2],
        "expanded (stride 0)": lambda: torch.randn(5, 1, k).expand(5, 6, k),
        "4-D": lambda: torch.randn(2, 3, 5, k),
        "permuted 5-D": lambda: torch.randn(2, k, 3, 4, 5).permute(0, 2, 3, 4, 1),
        "sliced rows": lambda: torch.randn(20, k)[::3],
        "offset": lambda: torch.randn(1000)[7 : 7 + 10 * k].view(10, k),
    }[layout]()
    with torch.no_grad():
        got = dense(x, w, b)
    assert spy.calls == 1
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=5e-5)


def test_dense_shape_mismatch_is_f_linears_error(spy: Spy) -> None:
    x, w, _ = _case(4, 32, 16, False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        dense(x[..., :31], w, None)
    assert spy.calls == 0


def test_torch_without_onednn_takes_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_onednn_op", None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(fused, "ONEDNN_MIN_MACS", 0)
    x, w, b = _case(4, 32, 16, True)
    with torch.no_grad():
        assert torch.equal(dense(x, w, b), F.linear(x, w, b))
    assert fused._onednn_op is False  # probed once, remembered


def test_model_logits_and_generation_equal_with_onednn_off(spy: Spy) -> None:
    """A decoder's no-grad forward (fused q/k/v and gate/up, the LM head) through oneDNN gives
    the logits F.linear gives, to float32 rounding."""
    torch.manual_seed(0)
    cfg = tiny_model_config(
        norm={"kind": "rmsnorm"}, ffn={"kind": "swiglu"}, attention={"n_heads": 4, "n_kv_heads": 2}
    )
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        on = model(ids).logits
        calls = spy.calls
        fused.ONEDNN = False
        off = model(ids).logits
    assert calls >= 1 + 3 * cfg.n_layers  # q/k/v, o, gate/up, down per layer and the head
    assert spy.calls == calls  # nothing through oneDNN with the flag off
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("", True), ("0", True), ("off", True), (" False ", True), ("1", False),
     ("yes", False), ("true", False)],
)  # fmt: skip
def test_lmlab_no_onednn_turns_it_off(value: str | None, on: bool) -> None:
    env = {} if value is None else {fused.OPT_OUT_ENV: value}
    assert fused.onednn_wanted(env) is on


def test_lmlab_no_onednn_is_read_at_import() -> None:
    import subprocess
    import sys

    code = "import lmlab.nn.fused as f; print(f.ONEDNN)"
    for value, want in (("1", "False"), ("0", "True")):
        env = {**os.environ, fused.OPT_OUT_ENV: value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want


def _xwb() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(5, 64, generator=g),
        torch.randn(48, 64, generator=g),
        torch.randn(48, generator=g),
    )


def test_forward_mode_ad_and_torch_func_take_f_linear(spy: Spy) -> None:
    """oneDNN's op has no forward-AD formula or batching rule: under jvp, jacfwd, vmap and
    dual tensors (all legal with gradients off) its tangents would be dropped silently."""
    from torch.autograd import forward_ad as fwAD
    from torch.func import jacfwd, jvp, vmap

    x, w, b = _xwb()
    ones = torch.ones_like(x)
    with torch.no_grad():
        for fn in (dense, F.linear):
            t = jvp(lambda a, fn=fn: fn(a, w, b), (x,), (ones,))[1]  # type: ignore[misc]
            torch.testing.assert_close(t, ones @ w.T)
        jac = jacfwd(lambda a: dense(a, w, b))(x)  # (5, 48, 5, 64)
        torch.testing.assert_close(jac[0, :, 0], w)  # d out[0] / d x[0]
        torch.testing.assert_close(
            vmap(lambda a: dense(a, w, b))(x[:, None]), F.linear(x, w, b)[:, None]
        )
        with fwAD.dual_level():
            out = dense(fwAD.make_dual(x, ones), w, b)
            tangent = fwAD.unpack_dual(out).tangent
        assert tangent is not None
        torch.testing.assert_close(tangent, ones @ w.T)
    assert spy.calls == 0


@pytest.mark.parametrize("kind", ["sparse coo", "sparse csr", "mkldnn", "nested", "csr weight"])
def test_non_strided_tensors_take_f_linear(spy: Spy, kind: str) -> None:
    x, w, b = _xwb()
    with torch.no_grad():
        if kind == "nested":
            n = torch.nested.nested_tensor([x[:2], x[2:]])
            got = dense(n, w, b)
            want = F.linear(n, w, b)
            for a, c in zip(got.unbind(), want.unbind(), strict=True):
                assert torch.equal(a, c)
        else:
            xs = {
                "sparse coo": x.to_sparse(),
                "sparse csr": x.to_sparse_csr(),
                "mkldnn": x.to_mkldnn(),
            }
            xi, wi = (x, w.to_sparse_csr()) if kind == "csr weight" else (xs[kind], w)
            got = dense(xi, wi, b)
            got = got.to_dense() if got.layout is not torch.strided else got
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert spy.calls == 0


def test_mkldnn_disabled_by_the_user_takes_f_linear(spy: Spy) -> None:
    x, w, b = _xwb()
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(dense(x, w, b), F.linear(x, w, b))
    assert spy.calls == 0


def test_traced_and_compiled_forwards_see_f_linear(spy: Spy) -> None:
    """torch.jit.trace records F.linear (oneDNN's op has no trace schema for its scalars), and
    torch.compile traces one graph through lmlab.nn.fused.linear (no graph break per layer)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 48), nn.Linear(48, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fused.linear(self.b, torch.relu(fused.linear(self.a, x)))

    x, _, _ = _xwb()
    with torch.no_grad():
        traced = torch.jit.trace(Net(), (x,))  # its check runs the eager forward too
        graph = str(traced.graph)
        assert "aten::linear" in graph and "mkldnn" not in graph
        explained = torch._dynamo.explain(Net())(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_a_weight_replaced_by_a_plain_attribute_is_not_a_plain_linear() -> None:
    lin = nn.Linear(8, 4)
    assert fused.plain_linear(lin)
    w = lin.weight.detach().clone()
    del lin.weight
    lin.weight = w  # type: ignore[assignment]  # a plain tensor attribute, not a parameter
    assert not fused.plain_linear(lin)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused.linear(lin, x), lin(x))  # the module's own call
