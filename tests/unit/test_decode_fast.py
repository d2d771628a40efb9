"""The decode fast paths (lmlab.nn.fused, the in-place KV cache, the per-forward RoPE memo, the
cast-free RMSNorm) compute what the plain paths compute, and never go stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmlab.generation.generate import SamplingParams, generate_batch, generate_ids
from lmlab.hooks import run_with_cache
from lmlab.models.decoder import DecoderLM
from lmlab.nn.fused import drop_fused, fused_linear
from lmlab.nn.kv_cache import LayerKVCache
from lmlab.nn.position import apply_rope
from lmlab.training.optim import build_optimizer
from tests.helpers import tiny_config, tiny_model_config

LLAMA = {
    "norm": {"kind": "rmsnorm"},
    "ffn": {"kind": "swiglu"},
    "position": {"kind": "rope"},
    "attention": {"n_heads": 4, "n_kv_heads": 2},
}


@pytest.fixture(autouse=True)
def fused_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests test the run-time fusion (lmlab.nn.fused.ENABLED, on by default) even if a
    caller switched it off."""
    monkeypatch.setattr("lmlab.nn.fused.ENABLED", True)


@pytest.fixture(scope="module")
def llama() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(tiny_model_config(**LLAMA)).eval()


def _grad_logits(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    """Logits of the plain path: with gradients on, no fused weight and no cache buffer."""
    with torch.enable_grad():
        return model(x).logits.detach()


def test_fused_qkv_and_gate_up_equal_the_separate_projections(llama: DecoderLM) -> None:
    x = torch.randint(0, 50, (2, 9))
    ref = _grad_logits(llama, x)
    with torch.no_grad():
        fast = llama(x).logits
    assert "_fused_linears" in llama.layers[0].attn.__dict__  # the fused path ran
    assert "_fused_linears" in llama.layers[0].ffn.__dict__
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    attn = llama.layers[0].attn
    h = torch.randn(3, 32)
    with torch.no_grad():
        qkv = fused_linear(attn, "qkv", ("q_proj", "k_proj", "v_proj"), h)
        sep = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
    assert qkv is not None
    torch.testing.assert_close(qkv, sep, rtol=0, atol=1e-6)


def test_fused_weight_is_rebuilt_after_an_optimizer_step_and_load_state_dict() -> None:
    torch.manual_seed(1)
    model = DecoderLM(tiny_model_config(**LLAMA))
    x = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        before = model(x).logits
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x, targets=x).loss.backward()
    opt.step()  # in place: bumps every parameter's version counter
    with torch.no_grad():
        after = model(x).logits
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, _grad_logits(model, x), rtol=0, atol=1e-5)
    torch.manual_seed(2)
    other = DecoderLM(tiny_model_config(**LLAMA))
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        loaded = model(x).logits
        theirs = other(x).logits
    torch.testing.assert_close(loaded, theirs, rtol=0, atol=1e-5)
    # a new tensor assigned through .data (no version bump, a new address) is seen too
    attn = model.layers[0].attn
    attn.q_proj.weight.data = torch.zeros_like(attn.q_proj.weight)
    with torch.no_grad():
        zeroed = model(x).logits
    torch.testing.assert_close(zeroed, _grad_logits(model, x), rtol=0, atol=1e-5)
    drop_fused(model)
    assert all("_fused_linears" not in m.__dict__ for m in model.modules())


def test_fused_path_skips_hooked_and_non_linear_modules(llama: DecoderLM) -> None:
    attn = llama.layers[1].attn
    seen: list[torch.Tensor] = []
    handle = attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.no_grad():
            llama(torch.randint(0, 50, (1, 5)))
    finally:
        handle.remove()
    assert len(seen) == 1  # the hooked projection was called as a module
    h = torch.randn(2, 32)

    class Scaled(nn.Linear):  # a subclass (as a quantized layer may be): not fused
        pass

    owner = nn.Module()
    owner.a, owner.b, owner.c = Scaled(32, 4), nn.Linear(32, 4), nn.Linear(32, 4, bias=False)
    with torch.no_grad():
        assert fused_linear(owner, "x", ("a", "b"), h) is None
        assert fused_linear(owner, "x", ("b", "c"), h) is None  # a bias on one only
        assert fused_linear(owner, "x", ("b", "b"), h) is not None
        owner.b.register_forward_pre_hook(lambda m, i: None)
        assert fused_linear(owner, "x", ("b", "b"), h) is None  # hooked since: declined
    assert fused_linear(owner, "x", ("c",), h) is None  # gradients on


def test_in_place_cache_equals_the_growing_cache() -> None:
    torch.manual_seed(3)
    ks = [torch.randn(2, 2, t, 4) for t in (5, 1, 1, 3, 1)]
    grown, placed = LayerKVCache(), LayerKVCache()
    for k in ks:
        with torch.enable_grad():
            ref = grown.update(k, -k)
        with torch.no_grad():
            got = placed.update(k, -k)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert placed._kbuf is not None  # written in place
    assert placed.seq_len == 11 and placed.nbytes() == grown.nbytes() == 2 * 2 * 2 * 11 * 4 * 4
    assert placed.reserved_bytes() >= placed.nbytes()
    first = placed.k
    with torch.no_grad():
        placed.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert torch.equal(first, grown.k)  # an earlier view is never overwritten
    # replaced from outside (a batch row kept): the buffer follows the new tensors
    placed.k, placed.v = placed.k[:1].clone(), placed.v[:1].clone()
    with torch.no_grad():
        k, v = placed.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert k.shape == (1, 2, 13, 4) and torch.equal(k[:, :, :11], grown.k[:1])


def test_decode_is_unchanged_by_the_fast_paths(llama: DecoderLM) -> None:
    """Greedy tokens and cached logits equal the plain (grad-enabled, cat-cache) path, for one
    prompt and a left-padded batch."""
    x = torch.randint(0, 50, (2, 10))
    cache_fast, cache_ref = llama.new_cache(), llama.new_cache()
    with torch.no_grad():
        fast = [llama(x[:, :6], cache=cache_fast).logits]
        fast += [llama(x[:, i : i + 1], cache=cache_fast).logits for i in range(6, 10)]
    with torch.enable_grad():
        ref = [llama(x[:, :6], cache=cache_ref).logits.detach()]
        ref += [llama(x[:, i : i + 1], cache=cache_ref).logits.detach() for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(fast, 1), torch.cat(ref, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(fast, 1), _grad_logits(llama, x), rtol=0, atol=1e-5)
    p = SamplingParams(max_new_tokens=40, temperature=0.0)  # past max_seq_len 32: a rebuild
    alone = [list(generate_ids(llama, row, p, 32)) for row in ([3, 4, 5], x[1].tolist())]
    assert generate_batch(llama, [[3, 4, 5], x[1].tolist()], p, 32) == alone


def test_hooks_still_see_q_k_v_per_head(llama: DecoderLM) -> None:
    x = torch.randint(0, 50, (1, 7))
    names = ["layers.0.attn.hook_q", "layers.0.attn.hook_k", "layers.0.attn.hook_v"]
    _, cache = run_with_cache(llama, x, names=names)
    assert cache["layers.0.attn.hook_q"].shape == (1, 4, 7, 8)
    assert cache["layers.0.attn.hook_k"].shape == (1, 2, 7, 8)
    attn = llama.layers[0].attn
    with torch.no_grad():
        h = llama.layers[0].attn_norm(llama.embed(x))
        v = attn.v_proj(h).view(1, 7, 2, 8).transpose(1, 2)
    torch.testing.assert_close(cache["layers.0.attn.hook_v"], v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_memo_and_roll_form_equal_apply_rope(interleaved: bool) -> None:
    cfg = tiny_model_config(position={"kind": "rope", "interleaved": interleaved})
    model = DecoderLM(cfg)
    pos = model.position
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8)
    positions = torch.arange(3, 8)
    cos, sin = pos.cos_sin(positions)
    want = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
    got = pos.rotate(q, k, positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # bit for bit
    assert pos.rotation(positions, q.dtype)[0] is pos.rotation(positions, q.dtype)[0]  # memo
    positions += 1  # modified in place: recomputed
    cos2, _ = pos.rotation(positions, q.dtype)
    assert torch.equal(cos2, pos.cos_sin(torch.arange(4, 9))[0])


OPTIMIZERS = {  # name -> (model -> optimizer); the fused kernels bump no version counter
    "lmlab adamw (fused kernel)": lambda m: build_optimizer(m, tiny_config().train),
    "lmlab muon + adamw": lambda m: build_optimizer(
        m, tiny_config(train={"optimizer": "muon"}).train
    ),
    "AdamW fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "AdamW foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True),
    "Adam fused": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=True),
    "SGD fused": lambda m: torch.optim.SGD(m.parameters(), lr=0.5, fused=True),
    "Muon": lambda m: torch.optim.Muon(
        [p for p in m.parameters() if p.dim() == 2 and p.shape[0] != 50], lr=0.05
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_weight_is_rebuilt_after_any_optimizer_step(name: str) -> None:
    """The trainer's evaluation: the gradients exist before the fused copy is built (no_grad
    eval between backward and step), then the step. ``AdamW(fused=True)`` (lmlab's default)
    writes the weights without a version bump: this copy went stale (issue 14, val loss off by
    up to 3e-3 in the resume tests)."""
    torch.manual_seed(4)
    model = DecoderLM(tiny_model_config(**LLAMA))
    opt = OPTIMIZERS[name](model)
    x = torch.randint(0, 50, (2, 7))
    model(x, targets=x).loss.backward()
    with torch.no_grad():
        before = model(x).logits  # builds the fused copies
    opt.step()
    with torch.no_grad():
        after = model(x).logits
    assert not torch.allclose(after, before)  # the step did change the weights
    torch.testing.assert_close(after, _grad_logits(model, x), rtol=0, atol=1e-5)


def test_fused_weight_is_rebuilt_after_a_hand_written_data_update() -> None:
    """A tutorial loop ``p.data -= lr * p.grad`` bumps no counter; its training forward (with
    gradients on) is what makes the copy stale."""
    torch.manual_seed(5)
    model = DecoderLM(tiny_model_config(**LLAMA))
    x = torch.randint(0, 50, (1, 6))
    for _ in range(2):
        with torch.no_grad():
            model(x)  # an evaluation: builds (then reuses) the fused copies
        model.zero_grad()
        model(x, targets=x).loss.backward()
        for p in model.parameters():
            p.data -= 0.5 * p.grad  # type: ignore[operator]
        with torch.no_grad():
            fast = model(x).logits
        torch.testing.assert_close(fast, _grad_logits(model, x), rtol=0, atol=1e-5)


def test_decode_reuses_the_fused_copy(llama: DecoderLM) -> None:
    """A decode loop (no_grad, no step) builds each fused weight once."""
    with torch.no_grad():
        llama(torch.randint(0, 50, (1, 4)))
    built = llama.layers[0].attn.__dict__["_fused_linears"]["qkv"].weight
    generate_ids(llama, [3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0), 32)
    assert llama.layers[0].attn.__dict__["_fused_linears"]["qkv"].weight is built


def test_trainer_val_loss_equals_the_unfused_one(tmp_path, monkeypatch) -> None:
    """lmlab's trainer evaluates twice with AdamW(fused=True) steps between: each val loss equals
    the one of the same run with the fusion off (stale copies gave 2e-4..3e-3 off)."""
    import json

    import lmlab.nn.fused as fused
    from lmlab.training.trainer import train

    cfg = {"max_steps": 4, "eval_every": 2, "warmup_steps": 1}
    vals = []
    for on in (True, False):
        monkeypatch.setattr(fused, "ENABLED", on)
        out = tmp_path / str(on)
        train(tiny_config(train=cfg), out=out, progress=False)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        vals.append([r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r])
    assert len(vals[0]) >= 2
    assert vals[0] == pytest.approx(vals[1], abs=1e-5, rel=0)
