"""lmlab's C++ quantized kernels (lmlab.nn.quant_kernel, quant_kernels.cpp): their output equals
x @ dequantize().T in float64 for int8 and int4 (symmetric and asymmetric) at 1..8 rows and odd
shapes, QuantLinear uses them for decode-sized CPU inputs, and the fallback (disabled by
LMLAB_NO_CPP_KERNELS or a failed build) gives the same numbers with its reason warned once."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.models.build import build_model
from lmlab.nn import quant_kernel
from lmlab.nn.quant import QuantLinear, dequantize_weight, quantize_model, unpack_int4
from tests.helpers import tiny_model_config
from tests.helpers.kernels import require_quant_kernels

# (N, K, group_size): N = 1; K % 8 != 0 (int8 13, int4 26); G % 8 != 0 (6, 10: chunks end inside
# a group), several groups per row (32 of 96), a SmolLM2-like K (576, G 32); G 48 and 26 take
# the AVX-512 int4 path's 32- and 16-code steps and leave the rest to the AVX2 loop and the tail;
# G % 32 == 0 (32, 64, 128: 4 blocks per group) takes the AVX-512 split-block int4 path
SHAPES = [(1, 64, 64), (5, 13, 13), (7, 26, 26), (9, 60, 6), (11, 40, 10), (3, 96, 32),
          (17, 576, 32), (4, 96, 48), (10, 256, 128)]  # fmt: skip
MODES = [(8, True), (4, True), (4, False)]  # (bits, symmetric); int8 is always symmetric


@pytest.fixture(scope="module", autouse=True)
def compiled(request: pytest.FixtureRequest) -> None:
    require_quant_kernels(request)


def _assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    """|a - b| <= tol (1 + |b|) everywhere, in float64."""
    a, b = a.detach().double(), b.detach().double()
    err = float(((a - b).abs() / (1 + b.abs())).max())
    assert err <= tol, err


def _layer(n: int, k: int, g: int, bits: int, sym: bool, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data *= 1 + 3 * torch.rand(n, 1)  # rows of different ranges
    return QuantLinear(lin, bits, g, sym, pad=False)


def _reference(ql: QuantLinear) -> torch.Tensor:
    """The float64 (N, K) weight of the module docstring's formula."""
    q = ql.qweight if ql.bits == 8 else unpack_int4(ql.qweight)
    return dequantize_weight(q, ql.scales.double(), ql.zeros.double(), ql.bits)


@pytest.mark.parametrize(("bits", "sym"), MODES)
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
def test_kernel_equals_float64_dequantized_matmul(n, k, g, bits, sym) -> None:
    if bits == 4 and k % 2:
        pytest.skip("int4 needs an even K")
    ql = _layer(n, k, g, bits, sym)
    w = _reference(ql)
    for m in range(1, quant_kernel.MAX_ROWS + 1):
        x = torch.randn(m, k)
        if bits == 8:
            y = quant_kernel.int8_mm(x, ql.qweight, ql.scales, g)
        else:
            y = quant_kernel.int4_mm(x, ql.qweight, ql.scales, ql.zeros, g)
        assert y.shape == (m, n) and y.dtype == torch.float32
        _assert_close(y, x.double() @ w.T)
    if bits == 4:  # the codes' -8 offset matters: the formula without it is far off
        codes = unpack_int4(ql.qweight).double().view(n, k // g, g)
        no_offset = codes * ql.scales.double()[..., None] + ql.zeros.double()[..., None]
        assert float((y.double() - x.double() @ no_offset.view(n, k).T).abs().max()) > 1e-2


def test_kernel_refuses_what_it_cannot_compute() -> None:
    ql = _layer(4, 32, 32, 4, False)
    with pytest.raises(ValueError, match="M <= 8"):
        quant_kernel.int4_mm(torch.randn(9, 32), ql.qweight, ql.scales, ql.zeros, 32)
    with pytest.raises(ValueError, match="shapes disagree"):
        quant_kernel.int4_mm(torch.randn(1, 30), ql.qweight, ql.scales, ql.zeros, 32)
    with pytest.raises(ValueError, match="contiguous"):
        quant_kernel.int4_mm(torch.randn(32, 2).T, ql.qweight, ql.scales, ql.zeros, 32)


@pytest.mark.parametrize(("bits", "sym"), MODES)
def test_layer_uses_the_kernel_for_few_rows_only(bits, sym, monkeypatch) -> None:
    """1..8 rows go through quant_kernel.run (0 and 9+ rows do not), with the layer's padding
    and bias, and equal the float64 formula."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(40, 24)  # K 40 padded to 64 by group 32
    ql = QuantLinear(lin, bits, 32, sym, pad=True)
    calls: list[int] = []
    real = quant_kernel.run

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(quant_kernel, "run", counting)
    w = _reference(ql)[:, :40]
    for rows in (1, 3, 8, 9, 0):
        x = torch.randn(rows, 2, 40)[:, 0].unsqueeze(0)  # (1, rows, 40), not contiguous
        y = ql(x)
        assert y.shape == (1, rows, 24)
        if rows:
            _assert_close(y, x.double() @ w.T + lin.bias.double())
    assert calls == [1, 3, 8]
    x = torch.randn(1, 1, 40)
    with quant_kernel.disabled():  # the benchmarks' A/B switch
        _assert_close(ql(x), x.double() @ w.T + lin.bias.double())
    assert calls == [1, 3, 8] and quant_kernel.available()


def _decode(model: torch.nn.Module) -> list[int]:
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    return list(generate_ids(model, [1, 2, 3, 4], params, 64, eos_id=None))


@pytest.mark.parametrize("bits", [8, 4])
def test_fallback_gives_the_same_numbers_and_says_why(bits, monkeypatch) -> None:
    """LMLAB_NO_CPP_KERNELS=1 and a failed build both fall back to torch's kernels / dequantize +
    matmul: a RuntimeWarning naming the reason, once; logits equal to 1e-5; greedy decoding of a
    tiny quantized model equal token for token."""
    torch.manual_seed(5)
    model = quantize_model(build_model(tiny_model_config(vocab_size=64)).eval(), bits, 32)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        fast_logits = model(ids[:, -1:]).logits
    fast_tokens = _decode(model)
    for how in ("env", "build"):
        quant_kernel._reset()
        if how == "env":
            monkeypatch.setenv("LMLAB_NO_CPP_KERNELS", "1")
        else:
            monkeypatch.delenv("LMLAB_NO_CPP_KERNELS", raising=False)

            def broken() -> None:
                raise OSError("no C++ compiler found\nc++: not found")

            monkeypatch.setattr(quant_kernel, "_build", broken)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                slow_logits = model(ids[:, -1:]).logits
            slow_tokens = _decode(model)
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        reason = "LMLAB_NO_CPP_KERNELS=1" if how == "env" else "c++: not found"
        assert len(said) == 1 and reason in said[0], said
        assert reason in quant_kernel.status() and not quant_kernel.available()
        _assert_close(slow_logits, fast_logits)
        assert slow_tokens == fast_tokens
        monkeypatch.undo()
    quant_kernel._reset()
    assert quant_kernel.available()


@pytest.mark.parametrize(("bits", "sym"), MODES)
@pytest.mark.parametrize(("n", "k", "g"), SHAPES)
def test_dequantize_equals_the_float64_formula(n, k, g, bits, sym) -> None:
    """The one-pass C++ dequantization (a prompt's path) is the module docstring's formula to
    float32 rounding, the int4 codes' -8 offset and nibble order included."""
    if bits == 4 and k % 2:
        pytest.skip("int4 needs an even K")
    ql = _layer(n, k, g, bits, sym)
    w = quant_kernel.dequantize(ql.qweight, ql.scales, ql.zeros, g, bits)
    assert w.shape == (n, k) and w.dtype == torch.float32
    ref = _reference(ql)
    assert float(((w.double() - ref).abs() / (1 + ref.abs())).max()) <= 1e-6
    torch.testing.assert_close(w, ql.dequantize(), rtol=1e-6, atol=1e-6)  # the torch ops


def test_dequantize_refuses_sizes_it_cannot_read() -> None:
    ql = _layer(4, 64, 32, 4, False)
    for g, bits in ((32, 3), (7, 4), (0, 8)):  # bits, an odd int4 group, no columns
        with pytest.raises(ValueError, match="refused"):
            quant_kernel.dequantize(ql.qweight, ql.scales, ql.zeros, g, bits)


@pytest.mark.parametrize(("bits", "act_bits"), [(8, None), (4, None), (4, 8)])
def test_a_prompt_dequantizes_in_one_c_pass(
    bits: int, act_bits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rows than the kernels take (a prompt) read the C++ dequantized weight, then one
    float32 matmul; with int8 activations they run through the integer kernels 8 rows at a
    time instead: x_hat @ w_hat.T as at 1..8 rows either way."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True)
    ql = QuantLinear(lin, bits, 32, False, pad=False, act_bits=act_bits)
    calls: list[int] = []
    real = quant_kernel.dequantize

    def spy(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_kernel, "dequantize", spy)
    x = torch.randn(3, 7, 96)  # 21 rows > MAX_ROWS
    with torch.no_grad():
        y = ql(x)
        few = torch.cat([ql(x.view(-1, 96)[i : i + 7]) for i in range(0, 21, 7)])  # the kernels
    assert calls == ([] if act_bits == 8 else [1])
    if act_bits == 8:  # the path before, fake-quantized activations: the same to rounding
        monkeypatch.setattr("lmlab.nn.quant.PROMPT_A8_KERNELS", False)
        with torch.no_grad():
            _assert_close(ql(x).view(-1, 40), few, tol=1e-4)
        assert calls == [1]
    assert y.shape == (3, 7, 40)
    if act_bits == 8:  # the same kernels on the same rows: what the decode steps compute, exactly
        assert torch.equal(y.view(-1, 40), few)
    else:
        _assert_close(y.view(-1, 40), few, tol=1e-5)
