"""The CUDA paths of the default model: bf16 autocast, the KV cache, the SDPA flash kernel and a
short training run (issue 14, "GPU"). Run by benchmarks/gpu_check.sh on a GPU machine.

The device is ``LMLAB_TEST_DEVICE`` (default ``cuda``). Without a CUDA GPU every test here skips
with the reason; ``LMLAB_TEST_DEVICE=cpu`` runs them on the CPU (gpu_check.sh's dry run uses that
to check the tests themselves, which has no bearing on CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from lmlab.config import ModelConfig, RunConfig
from lmlab.models import build_model
from lmlab.training.hardware import resolve_precision

DEVICE = torch.device(os.environ.get("LMLAB_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
    "benchmarks/gpu_check.sh runs these on a GPU machine",
)
VOCAB = 65


def default_model_config() -> ModelConfig:
    """The library's default model (the classic Mini-GPT: 6 layers, d 256, ctx 256, RoPE)."""
    cfg = RunConfig().validate().model
    cfg.vocab_size = VOCAB
    return cfg


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(default_model_config()).to(DEVICE)


def _batch(b: int = 4, t: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g).to(DEVICE)


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, targets=x).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def test_bf16_autocast_forward_backward_equals_fp32_within_tolerance(model) -> None:
    x = _batch()
    seen: list[torch.dtype] = []
    hook = model.layers[0].attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        loss32, g32 = _loss_and_grads(model, x, bf16=False)
        loss16, g16 = _loss_and_grads(model, x, bf16=True)
    finally:
        hook.remove()
    assert seen == [torch.float32, torch.bfloat16]  # the autocast pass really ran in bf16
    assert abs(loss16.item() - loss32.item()) < 0.01 * loss32.item()
    assert g32.keys() == g16.keys()
    for name, ref in g32.items():
        # bf16 has 8 bits of mantissa: a relative error of a few 1e-3 per product, a few 1e-2
        # after a deep backward; a wrong kernel (or a dropped term) gives O(1)
        err = (g16[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < 0.05, f"{name}: relative gradient error {err:.3g} in bf16"


def test_cached_decoding_equals_the_full_forward(model) -> None:
    model.eval()
    x = _batch(b=2, t=48, seed=2)
    with torch.no_grad():
        full = model(x).logits.float()
        cache = model.new_cache()
        steps = [model(x[:, :16], cache=cache).logits.float()]
        for t in range(16, x.shape[1]):
            steps.append(model(x[:, t : t + 1], cache=cache).logits.float())
    model.train()
    cached = torch.cat(steps, dim=1)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=2e-4)


def test_cached_greedy_generation_equals_argmax_of_the_full_pass(model) -> None:
    from lmlab.generation.generate import SamplingParams, generate_ids

    model.eval()
    prompt = _batch(b=1, t=8, seed=3)[0].tolist()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    out = list(generate_ids(model, prompt, params, model.cfg.max_seq_len, eos_id=None))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids], device=DEVICE)).logits[0, -1].float()
            ids.append(int(logits.argmax()))
    model.train()
    assert out == ids[len(prompt) :]


def _attention_output(model, x, backend) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    model.zero_grad(set_to_none=True)
    with sdpa_kernel([backend]), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = model(x).logits
        logits.float().square().mean().backward()
    grad = model.layers[0].attn.q_proj.weight.grad.detach().float().clone()
    model.zero_grad(set_to_none=True)
    return logits.detach().float(), grad


def test_default_attention_runs_on_the_flash_kernel_and_matches_the_math_backend(
    model, monkeypatch
) -> None:
    """With only FLASH_ATTENTION allowed, SDPA raises when the call is not flash-eligible (an
    explicit mask, fp32, an odd head size): the default model's training forward must be."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    assert model.cfg.attention.backend == "sdpa"
    x = _batch(b=2, t=128, seed=4)
    calls: list[tuple] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.dtype, k.dtype, v.dtype, kw.get("attn_mask") is None, kw.get("is_causal")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        model(x)
    monkeypatch.undo()
    # what flash needs, checkable on any device: bf16 q/k/v (RoPE keeps the dtype), no mask
    assert calls == [(torch.bfloat16,) * 3 + (True, True)] * model.cfg.n_layers
    flash, g_flash = _attention_output(model, x, SDPBackend.FLASH_ATTENTION)
    math, g_math = _attention_output(model, x, SDPBackend.MATH)
    torch.testing.assert_close(flash, math, rtol=0.02, atol=0.05)
    err = (g_flash - g_math).norm() / g_math.norm()
    assert err < 0.05, f"flash vs math gradient error {err:.3g}"


def test_default_attention_fp32_runs_on_the_memory_efficient_kernel(model) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if DEVICE.type != "cuda":
        pytest.skip("the memory-efficient SDPA kernel is CUDA's")
    x = _batch(b=2, t=128, seed=5)
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            eff = model(x).logits
        with sdpa_kernel([SDPBackend.MATH]):
            ref = model(x).logits
    torch.testing.assert_close(eff, ref, rtol=1e-4, atol=2e-4)


def test_twenty_steps_with_precision_auto_lower_the_loss(tmp_path: Path) -> None:
    from lmlab.config import config_from_dict
    from lmlab.training.trainer import train

    cfg = config_from_dict(
        {
            "name": "gpu20",
            "model": {"d_model": 128, "n_layers": 2, "max_seq_len": 64},
            "train": {
                "max_steps": 20,
                "batch_size": 16,
                "lr": 3e-3,
                "warmup_steps": 2,
                "eval_every": 20,
                "eval_batches": 2,
                "log_every": 1,
                "precision": "auto",
                "device": DEVICE.type,
                "checkpoint_interval_s": 3600.0,
            },
        }
    ).validate()
    res = train(cfg, out=tmp_path / "run", progress=False)
    assert res.step == 20
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    expected = "bf16" if DEVICE.type == "cuda" else resolve_precision("auto", DEVICE)
    assert saved["train"]["precision"] == expected
    assert saved["train"]["device"] in (DEVICE.type, str(DEVICE))
    assert res.train_loss is not None and res.val_loss is not None
    # a uniform guess over 65 characters costs ln 65 = 4.17 nats; 20 steps of a char model get
    # well under it (about 3.3 on the CPU)
    assert res.train_loss < 3.6, res.train_loss
    assert res.val_loss < 3.6, res.val_loss
