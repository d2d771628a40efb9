"""int8 activations (``act_bits=8``, ``--quantize int4+a8``): the C++ kernels quantize each row of
x to int8 per block of 32 (or of the group) and take integer dot products. Their output equals a
float64 product of the same quantized activations (lmlab.nn.quant.quantize_activations) with the
dequantized weight, at 1..8 rows, odd shapes and several group sizes, on every build (VNNI,
AVX2-only maddubs, plain loops) and on the Python fallback; and it stays within the bound that
activation rounding allows of the float-activation product."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.models.build import build_model
from lmlab.nn import cpp_build, quant_kernel
from lmlab.nn.quant import (
    QuantLinear,
    QuantSpec,
    act_block,
    dequantize_weight,
    parse_spec,
    quantize_activations,
    quantize_model,
    unpack_int4,
)
from lmlab.training.hardware import cpu_flags
from tests.helpers import tiny_model_config
from tests.helpers.kernels import require_quant_kernels

# (N, K, G): several 32-blocks per group (64, 128, whole row 96 / 576: the SIMD path), G not a
# multiple of 32 (6, 10, 26, 13: one block per group, the plain loops), odd N
SHAPES = [(1, 64, 64), (5, 13, 13), (7, 26, 26), (9, 60, 6), (11, 40, 10), (3, 96, 32),
          (17, 576, 32), (5, 256, 128), (9, 96, 96), (3, 576, 576)]  # fmt: skip
MODES = [(8, True), (4, True), (4, False)]


@pytest.fixture(scope="module", autouse=True)
def compiled(request: pytest.FixtureRequest) -> None:
    require_quant_kernels(request)


def _layer(n: int, k: int, g: int, bits: int, sym: bool, act_bits: int | None = 8) -> QuantLinear:
    torch.manual_seed(n * 1000 + k + g)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data *= 1 + 3 * torch.rand(n, 1)
    return QuantLinear(lin, bits, g, sym, pad=False, act_bits=act_bits)


def _weight(ql: QuantLinear) -> torch.Tensor:
    q = ql.qweight if ql.bits == 8 else unpack_int4(ql.qweight)
    return dequantize_weight(q, ql.scales.double(), ql.zeros.double(), ql.bits)  # (N, K) f64


def _x_hat(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat (M, K) float64, d (M, K/A) float64) of quantize_activations."""
    a = act_block(g)
    q, d = quantize_activations(x, a)
    m, k = x.shape
    return (q.double().view(m, -1, a) * d.double()[..., None]).view(m, k), d.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (1 + b.abs())).max())


def _kernel(ql: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    g = ql.group_size
    if ql.bits == 8:
        return quant_kernel.int8_mm(x, ql.qweight, ql.scales, g, act_bits=8)
    return quant_kernel.int4_mm(x, ql.qweight, ql.scales, ql.zeros, g, act_bits=8)


def _check_layer(ql: QuantLinear, fn, rows=range(1, quant_kernel.MAX_ROWS + 1)) -> None:
    """fn(x) equals x_hat @ w.T in float64 (1e-5) and is within the rounding bound of x @ w.T."""
    n, k, g = ql.out_features, ql.in_features, ql.group_size
    w = _weight(ql)
    torch.manual_seed(k + n)
    for m in rows:
        x = torch.randn(m, k) * (1 + 4 * torch.rand(m, 1))
        x[0, : min(k, act_block(g))] = 0.0  # an all-zero block: d = 0, q = 0
        y = fn(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        xh, d = _x_hat(x, g)
        ref = xh @ w.T
        assert _rel(y, ref) <= 1e-5
        # |x - x_hat| <= d / 2 per element, so |y - x @ w.T| <= sum_k |w[n, k]| d(k) / 2
        a = act_block(g)
        bound = (d.repeat_interleave(a, dim=1) / 2) @ w.abs().T  # (M, N)
        exact = x.double() @ w.T
        assert bool(((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all())


@pytest.mark.parametrize(("bits", "sym"), MODES)
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
def test_kernel_equals_float64_of_the_quantized_activations(n, k, g, bits, sym) -> None:
    if bits == 4 and (k % 2 or g % 2):
        pytest.skip("int4 needs an even K and group")
    ql = _layer(n, k, g, bits, sym)
    _check_layer(ql, lambda x: _kernel(ql, x))


def test_the_activations_are_really_rounded() -> None:
    """The int8-activation result differs from the float-activation one by far more than the
    tolerance above (so that test would fail if x were not quantized), and int4's offset term
    (z - 8 s) * sum(x_hat) matters."""
    ql = _layer(64, 576, 32, 4, False)
    x = torch.randn(2, 576)
    y8, w = _kernel(ql, x), _weight(ql)
    assert _rel(y8, x.double() @ w.T) > 1e-4
    codes = unpack_int4(ql.qweight).double().view(64, 18, 32)
    no_offset = (codes * ql.scales.double()[..., None]).view(64, 576)
    assert _rel(y8, _x_hat(x, 32)[0] @ no_offset.T) > 1e-2


def test_a_nan_or_inf_input_gives_nan_as_the_float_path_does() -> None:
    ql = _layer(8, 64, 32, 4, False)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64)
        x[1, 3] = bad
        y = _kernel(ql, x)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
        assert torch.isnan(ql(torch.cat([x, x, x, x, x]))[1]).all()  # 10 rows: the torch path


def test_quantize_activations_is_round_to_nearest_per_block() -> None:
    x = torch.tensor([[127.0, 0.5, -1.5, 2.5, 0.0, 0.0, 0.0, 0.0]])
    q, d = quantize_activations(x, 4)
    assert d.tolist() == [[1.0, 0.0]]
    assert q.tolist() == [[127.0, 0.0, -2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]  # half to even
    assert act_block(32) == act_block(576) == 32 and act_block(26) == 26


@pytest.mark.parametrize("limit", ["avx2", "generic", "avxvnni", "avx512"])
def test_builds_without_vnni_or_avx_give_the_same_numbers(limit, monkeypatch) -> None:
    """The AVX2-only build (maddubs instead of VNNI), the plain-loop build, the AVX-VNNI
    build (256-bit, where the CPU has it) and the AVX-512F build without VNNI (its wide
    float-activation paths, where the CPU has AVX-512F) agree with the float64 reference as
    tightly as the full build, with float activations too."""
    if limit == "avxvnni" and "avx_vnni" not in cpu_flags():
        pytest.skip("the CPU has no AVX-VNNI")
    if limit == "avx512" and not cpp_build.cpu_has_avx512f():
        pytest.skip("the CPU has no AVX-512F")
    try:
        lib = quant_kernel._build(limit)
    except Exception as e:  # pragma: no cover - no compiler for this variant
        pytest.skip(f"cannot build the {limit} variant: {e}")
    assert lib.lmlab_kernels_vnni() == (2 if limit == "avxvnni" else 0)
    assert lib.lmlab_kernels_avx2() == (limit != "generic" and cpp_build.cpu_has_avx2_fma())
    assert lib.lmlab_kernels_avx512() == (limit == "avx512")
    monkeypatch.setattr(quant_kernel._kernels, "lib", lib)
    for bits, sym in MODES:
        for n, k, g in [(17, 576, 32), (9, 60, 6), (5, 256, 128)]:
            ql = _layer(n, k, g, bits, sym)
            _check_layer(ql, lambda x, ql=ql: _kernel(ql, x), rows=(1, 4, 8))
    for bits, sym in MODES:  # float activations: int4_mm / int8_mm against float64 x @ w.T
        for n, k, g in [(17, 576, 32), (4, 96, 48), (10, 256, 128), (9, 60, 6)]:
            ql = _layer(n, k, g, bits, sym, act_bits=None)
            w = _weight(ql)
            for m in (1, 4, 8):
                x = torch.randn(m, k)
                if bits == 8:
                    y = quant_kernel.int8_mm(x, ql.qweight, ql.scales, g)
                else:
                    y = quant_kernel.int4_mm(x, ql.qweight, ql.scales, ql.zeros, g)
                assert _rel(y, x.double() @ w.T) <= 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_layer_fallback_gives_the_same_numbers(bits, monkeypatch) -> None:
    """QuantLinear with act_bits=8: the kernel (1..8 rows), more rows (dequantize + matmul of
    the rounded activations), quant_kernel.disabled() and LMLAB_NO_CPP_KERNELS=1 all compute
    x_hat @ w_hat.T."""
    ql = _layer(24, 64, 32, bits, False)
    _check_layer(ql, ql, rows=(1, 5, 8, 9, 20))
    with quant_kernel.disabled():
        _check_layer(ql, ql, rows=(1, 8))
    quant_kernel._reset()
    monkeypatch.setenv("LMLAB_NO_CPP_KERNELS", "1")
    with pytest.warns(RuntimeWarning, match="LMLAB_NO_CPP_KERNELS"):
        assert not quant_kernel.available()
    _check_layer(ql, ql, rows=(1, 3))
    monkeypatch.undo()
    quant_kernel._reset()


def test_spec_text_and_refusals() -> None:
    assert parse_spec("int4+a8") == QuantSpec(4, 32, act_bits=8)
    assert parse_spec("int4:64+a8") == QuantSpec(4, 64, act_bits=8)
    assert parse_spec("int8+a8").name == "int8-a8" and parse_spec("int4").act_bits is None
    for bad in ("int4+a4", "int4+", "int4+a8+a8", "a8", "int4:+a8"):
        with pytest.raises(LmlabError, match="--quantize"):
            parse_spec(bad)
    with pytest.raises(LmlabError, match="act_bits must be None .* or 8, got 4"):
        QuantSpec(4, 32, act_bits=4).check()
    model = build_model(tiny_model_config(vocab_size=64)).eval()
    with pytest.raises(LmlabError, match="act_bits"):
        quantize_model(model, 4, 32, act_bits=16)
    with pytest.raises(ValueError, match="act_bits"):
        quant_kernel.int8_mm(torch.randn(1, 32), torch.zeros(4, 32, dtype=torch.int8),
                             torch.ones(4, 1), 32, act_bits=4)  # fmt: skip


def test_quantized_model_records_and_applies_the_setting() -> None:
    torch.manual_seed(0)
    model = quantize_model(build_model(tiny_model_config(vocab_size=64)).eval(), 4, 32, act_bits=8)
    assert model.quantization == QuantSpec(4, 32, act_bits=8)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.act_bits == 8 for m in layers)
    assert "act_bits=8" in repr(layers[0])


@pytest.mark.parametrize(("bits", "g", "act_bits"), [(4, 32, 8), (4, 32, None), (8, 576, 8),
                                                    (8, 64, 8), (8, 576, None)])  # fmt: skip
def test_rows_split_over_two_threads_equal_one_thread(bits, g, act_bits) -> None:
    """Decode's layers are split over threads by output rows (64K weights per task at least);
    each row is computed the same way whatever range holds it (4 rows per pass, the rest one by
    one), so 2 threads give exactly the 1-thread result, with ranges of odd lengths."""
    ql = _layer(301, 576, g, bits, bits == 8, act_bits=act_bits)
    torch.manual_seed(1)
    before = torch.get_num_threads()
    for m in (1, 3, quant_kernel.MAX_ROWS):
        x = torch.randn(m, 576)
        if act_bits:
            direct = lambda x: _kernel(ql, x)  # noqa: E731
        elif bits == 4:
            direct = lambda x: quant_kernel.int4_mm(x, ql.qweight, ql.scales, ql.zeros, g)  # noqa: E731
        else:
            direct = lambda x: quant_kernel.int8_mm(x, ql.qweight, ql.scales, g)  # noqa: E731
        torch.set_num_threads(1)
        one = direct(x)
        torch.set_num_threads(2)
        try:
            two = direct(x)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)
