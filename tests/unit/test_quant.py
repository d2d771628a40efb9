"""Weight-only int8 / int4 quantization (lmlab.nn.quant): the kernels' semantics, the layer
against its float64 formula, the rounding bound, tied heads, refusals, cached decoding, round
trips and the --quantize flag."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.models.build import build_model
from lmlab.nn.quant import (
    QuantLinear,
    apply_quantization,
    dequantize_weight,
    pack_int4,
    parse_spec,
    quantize_model,
    quantize_weight,
    unpack_int4,
)
from tests.helpers import TINY, assert_one_error, run_cli, tiny_model_config

# (bits, group_size, symmetric, kernel the layer must pick for (N, K) = (48, 128))
MODES = [
    (8, None, True, "int8pack"),
    (8, 32, True, None),  # group-wise int8: the kernel takes one scale per row only
    (4, 32, False, "int4pack"),
    (4, 64, True, "int4pack"),
    (4, 16, False, None),  # the int4 kernel needs G in {32, 64, 128, 256}
]


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(tiny_model_config(vocab_size=64)).eval()


def _assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    """|a - b| <= tol (1 + |b|) everywhere (float64 comparisons of float32 results)."""
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs() / (1 + b.abs())
    assert float(err.max()) <= tol, float(err.max())


def _fresh(tiny: torch.nn.Module) -> torch.nn.Module:
    model = build_model(tiny.cfg).eval()
    model.load_state_dict(tiny.state_dict())
    return model


def test_kernel_semantics_are_the_documented_formulas() -> None:
    """aten._weight_int8pack_mm is x @ (w * s[:, None]).T; _weight_int4pack_mm_for_cpu is
    x @ ((q - 8) * s + z).T per group, with sz (K/G, N, 2) and q converted from (N, K) int32."""
    torch.manual_seed(1)
    x = torch.randn(3, 64)
    w8 = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s = torch.rand(16)
    y8 = torch.ops.aten._weight_int8pack_mm(x, w8, s)
    ref8 = x.double() @ (w8.double() * s.double()[:, None]).T
    _assert_close(y8.double(), ref8)
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    sc, z = torch.rand(2, 16), torch.randn(2, 16)  # (K/G, N) for G = 32
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    y4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.stack([sc, z], -1))
    w = (q.double() - 8) * sc.T.double().repeat_interleave(32, 1) + z.T.double().repeat_interleave(
        32, 1
    )
    _assert_close(y4.double(), x.double() @ w.T)
    wrong = q.double() * sc.T.double().repeat_interleave(32, 1)  # without the -8 offset
    assert (y4.double() - x.double() @ wrong.T).abs().max() > 1


@pytest.mark.parametrize(("bits", "group", "sym", "kernel"), MODES)
@pytest.mark.parametrize("rows", [1, 16])  # 1: the kernel (where it applies); 16: dequant + mm
def test_layer_equals_float64_dequantized_matmul(bits, group, sym, kernel, rows) -> None:
    torch.manual_seed(2)
    lin = torch.nn.Linear(128, 48)
    ql = QuantLinear(lin, bits, group, sym, pad=False)
    assert ql.kernel == kernel
    x = torch.randn(2, rows, 128)
    q = ql.qweight if bits == 8 else unpack_int4(ql.qweight)
    w = dequantize_weight(q, ql.scales.double(), ql.zeros.double(), bits)  # float64 formula
    ref = x.double() @ w.T + lin.bias.double()  # (2, rows, 48)
    _assert_close(ql(x).double(), ref)
    # the layer is near the float layer it replaced (int8 much nearer than int4)
    err = (ql(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert err < (0.01 if bits == 8 else 0.1)


@pytest.mark.parametrize(("bits", "group", "sym"), [(8, 16, True), (4, 32, False), (4, 32, True)])
def test_round_trip_error_is_at_most_half_a_scale(bits, group, sym) -> None:
    torch.manual_seed(3)
    w = torch.randn(40, 96) * torch.rand(40, 1) * 3
    w[0] = 0.5  # a constant row: asymmetric int4 holds it exactly
    w[1, :group] = 0.0  # an all-zero group
    q, s, z = quantize_weight(w, bits, group, sym)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    lo, hi = (-127, 127) if bits == 8 else (0, 15)
    assert int(q.min()) >= lo and int(q.max()) <= hi
    w_hat = dequantize_weight(q, s.double(), z.double(), bits)
    bound = s.double().repeat_interleave(group, 1) / 2  # (N, K)
    err = (w_hat - w.double()).abs()
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert float((err / bound).max()) > 0.9  # the bound is tight: not trivially met
    assert float(err[1, :group].max()) == 0.0
    if bits == 4 and not sym:
        assert float(err[0].max()) < 1e-7


def test_int4_packing_round_trips() -> None:
    q = torch.randint(0, 16, (5, 8), dtype=torch.uint8)
    p = pack_int4(q)
    assert p.shape == (5, 4) and torch.equal(unpack_int4(p), q)
    assert int(p[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)


def test_tied_head_gets_its_own_quantized_copy_and_embedding_stays(tiny) -> None:
    model = _fresh(tiny)
    assert model.lm_head.weight is model.embed.weight
    before = model.embed.weight.detach().clone()
    quantize_model(model, bits=4, group_size=32)
    assert isinstance(model.lm_head, QuantLinear) and model.tied is None
    assert isinstance(model.embed.weight, torch.nn.Parameter)
    assert torch.equal(model.embed.weight, before)  # the embedding is still float, unchanged
    assert isinstance(model.layers[0].attn.q_proj, QuantLinear)
    kept = quantize_model(_fresh(tiny), bits=8, head=False)
    assert type(kept.lm_head) is torch.nn.Linear and kept.lm_head.weight is kept.embed.weight


def test_refusals_name_the_problem() -> None:
    lin = torch.nn.Linear(96, 32)
    with pytest.raises(LmlabError, match="bits must be 4 or 8, got 3"):
        quantize_model(torch.nn.Sequential(lin), bits=3)
    with pytest.raises(LmlabError, match="head_bits must be 4 or 8, got 2"):
        quantize_model(torch.nn.Sequential(lin), bits=4, group_size=32, head_bits=2)
    with pytest.raises(LmlabError, match=r"cannot quantize 0: group_size 64 does not divide .* 96"):
        quantize_model(torch.nn.Sequential(lin), bits=4, group_size=64)
    assert type(lin) is torch.nn.Linear  # nothing replaced before the refusal
    padded = QuantLinear(lin, 4, 64, False, pad=True)  # K padded 96 -> 128 instead
    x = torch.randn(3, 96)
    ref = x.double() @ padded.dequantize().double().T + lin.bias.double()
    _assert_close(padded(x).double(), ref)
    for bad in ("int3", "int4:x", "fp8"):
        with pytest.raises(LmlabError, match="must be int8 or int4"):
            parse_spec(bad)
    assert parse_spec("int4:64").group_size == 64 and parse_spec("int8").group_size is None
    for bad in ("int4+h8", "int4+a8+a8", "int4+h4+h4", "int4+", "int4+A8", "int4+h4 "):
        with pytest.raises(LmlabError, match=r"\+h4 \(a 4-bit LM head\) and \+a8"):
            parse_spec(bad)
    assert parse_spec("int4").head_bits == 8 and parse_spec("int8").head_bits == 8
    both = parse_spec("int4:64+h4+a8")
    assert (both.head_bits, both.act_bits, both.group_size) == (4, 8, 64)
    assert parse_spec("int4+a8+h4") == both.__class__(4, 32, act_bits=8, head_bits=4)
    assert both.name == "int4-g64-h4-a8" and parse_spec("int4+a8").name == "int4-g32-a8"


def test_the_head_is_int8_unless_h4(tiny) -> None:
    """The default head is int8 with the layers' group (a Q8_0-like head next to Q4_1-like
    layers), so its logits are much closer to float's than an int4 head's; +h4 rounds it to 4."""
    base = _fresh(tiny)
    x = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        ref = base(x).logits
        out = {}
        for spec in ("int4", "int4+h4"):
            model = apply_quantization(_fresh(tiny), spec)
            head, layer = model.lm_head, model.layers[0].ffn.down_proj
            assert isinstance(head, QuantLinear) and layer.bits == 4 and head.group_size == 32
            assert head.bits == (4 if spec.endswith("h4") else 8)
            assert model.layers[0].attn.q_proj.bits == 4
            out[spec] = model(x).logits
    err8 = float((out["int4"] - ref).abs().max())
    err4 = float((out["int4+h4"] - ref).abs().max())
    assert err8 < err4


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_cached_greedy_decoding_equals_full_recomputation(tiny, spec) -> None:
    """The cache feeds one row at a time (the kernels); the full pass 6+ rows (dequant + mm)."""
    model = quantize_model(_fresh(tiny), **vars(parse_spec(spec)))
    prompt = [3, 14, 15, 9, 2, 6]
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    cached = list(generate_ids(model, prompt, params, model.cfg.max_seq_len, eos_id=None))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached == ids[len(prompt) :]


def test_state_dict_round_trip(tiny) -> None:
    model = quantize_model(_fresh(tiny), bits=4, group_size=32, head_bits=4)
    sd = model.state_dict()
    assert sd["lm_head.qweight"].dtype == torch.uint8 and "lm_head.weight" not in sd
    torch.manual_seed(9)  # another float model: its own codes until the load replaces them
    other = quantize_model(build_model(tiny.cfg).eval(), bits=4, group_size=32, head_bits=4)
    other.load_state_dict(sd)
    x = torch.tensor([[1, 2, 3]])  # 3 rows: dequant path; 1 row: the kernel's rebuilt operands
    with torch.no_grad():
        assert torch.equal(other(x).logits, model(x).logits)
        assert torch.equal(other(x[:, :1]).logits, model(x[:, :1]).logits)


def test_cli_quantize_flag(tiny_run, capsys) -> None:
    import lmlab

    flags = ("--temperature", "0", "--max-new-tokens", "8", "--no-prompt", "--quantize", "int8")
    code, out, err = run_cli(capsys, "generate", tiny_run, "--prompt", "ab", *flags)
    assert code == 0, err
    model, tok = lmlab.load(tiny_run, quantize="int8")
    assert isinstance(model.layers[0].attn.q_proj, QuantLinear)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    ids = generate_ids(model, tok.encode("ab"), params, model.cfg.max_seq_len, eos_id=None)
    assert out.rstrip("\n") == tok.decode(list(ids))
    scores = {}
    for q in (None, "int4"):
        flags = ["--quantize", q] if q else []
        code, out, err = run_cli(capsys, "eval", tiny_run, "--max-tokens", "200", "--json", *flags)
        assert code == 0, err
        scores[q] = out
    assert scores[None] != scores["int4"]  # the flag changed the model that was scored
    code, _, err = run_cli(capsys, "eval", tiny_run, "--quantize", "int3")
    assert_one_error(code, err, "must be int8 or int4")
    code, _, err = run_cli(capsys, "eval", tiny_run, "--quantize", "int4:24")
    assert_one_error(code, err, "cannot quantize", "group_size 24 does not divide", "32")
    code, out, _ = run_cli(capsys, "generate", "--help")
    assert "--quantize" in out and "int4:64" in out and "+a8" in out
    # int8 activations: the eval changes again (rounded activations), a bad suffix is one error
    code, out, err = run_cli(capsys, "eval", tiny_run, "--max-tokens", "200", "--json",
                             "--quantize", "int4+a8")  # fmt: skip
    assert code == 0, err
    assert out != scores["int4"]
    code, _, err = run_cli(capsys, "eval", tiny_run, "--quantize", "int4+a4")
    assert_one_error(code, err, "must be int8 or int4", "+a8", "'int4+a4'")


@pytest.mark.parametrize(
    "model",
    [{"ffn": {"kind": "moe"}}, {"attention": {"kind": "mla", "kv_lora_rank": 16, "absorb": True}}],
)
def test_variants_reading_a_weight_keep_it_float(model) -> None:
    """keep_float: the MoE router and MLA's kv_b_proj stay nn.Linear; decoding still matches."""
    cfg = tiny_model_config(vocab_size=64, **{k: {**TINY["model"].get(k, {}), **v}
                                              for k, v in model.items()})  # fmt: skip
    m = quantize_model(build_model(cfg).eval(), bits=8)
    kept = [n for n, mod in m.named_modules() if type(mod) is torch.nn.Linear]
    assert kept and all(n.endswith(("router", "kv_b_proj")) for n in kept)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    cached = list(generate_ids(m, [1, 2, 3], params, cfg.max_seq_len, eos_id=None))
    ids = [1, 2, 3]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached == ids[3:]


@pytest.mark.parametrize("spec", [8, b"int4+a8", None, 4.0])
def test_quantize_that_is_not_text_is_one_lmlab_error(tiny, spec) -> None:
    with pytest.raises(LmlabError, match="quantize must be a string like 'int4'"):
        apply_quantization(tiny, spec)


def test_cli_shows_the_kernel_fallback_warning_as_one_line(tiny_run, capsys, monkeypatch) -> None:
    from lmlab.nn import quant_kernel

    quant_kernel._reset()
    monkeypatch.setenv("LMLAB_NO_CPP_KERNELS", "1")
    try:
        code, _, err = run_cli(capsys, "generate", tiny_run, "--prompt", "ab",
                               "--max-new-tokens", "3", "--quantize", "int4:16+a8")  # fmt: skip
    finally:
        monkeypatch.undo()
        quant_kernel._reset()
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "C++ quantized kernels" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: lmlab's C++ quantized kernels")
    assert "LMLAB_NO_CPP_KERNELS=1" in lines[0]
    assert "quant.py" not in err and "RuntimeWarning" not in err  # no file:line, no source line
