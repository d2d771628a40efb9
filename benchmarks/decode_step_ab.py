"""One decode step of SmolLM2-135M, timed side by side: lmlab's forward, lmlab's lean step,
transformers (and, with ``--compile``, a torch.compile'd layer step), interleaved in one process.

Each contender decodes from its own cache after the same 64-token prefill (``--prefill N``: N
tokens); a round times one step of each, in turn; best and median over ``--steps`` rounds (the
best is the least disturbed by other load, the figure to read on a shared machine). ``--twin``:
the same 30-layer config at d_model 72, d_ff 96, vocab 256 with random weights, whose step is
almost all per-token overhead.
``--quantize int4`` (or int8): lmlab's contenders on the quantized model (transformers is left
out). ``--compile``: one layer's step as a pure function (static KV buffers of 512 slots and a
position mask, the weights as arguments, so one graph serves every layer and step), compiled with
``torch.compile(fullgraph=True, dynamic=False)``; its compile seconds and its largest logit
difference from the forward are printed (float32, RMSNorm / SwiGLU / full RoPE models only).
``lean`` is the lean step as generation runs it (one C++ call per token where
lmlab.nn.decode_kernel applies), ``lean_py`` its Python loop (the C++ step's A/B).
``--lean-from FILE``: another checkout's lean_step.py (say the main branch's) as one more
contender, ``lean_base``, on its own cache (A/B of a change to the lean step in one process).

Also printed: profiler events (aten ops, nested ones included) of one step of each lmlab path.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_step_ab.py --threads 1 --steps 40
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_step_ab.py --threads 1 --twin --compile
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from quantized_quality import smollm2_path  # benchmarks/ is on sys.path
from smollm2_decode import hf_copy

import lmlab.nn.fused
from lmlab.generation.lean_step import LeanStep, lean_refusal
from lmlab.interop.load import load
from lmlab.models.decoder import DecoderLM
from lmlab.nn import decode_kernel
from lmlab.nn.quant import apply_quantization

SLOTS = 512


def compiled_step(model: DecoderLM, prompt: torch.Tensor) -> tuple[Callable, float]:
    """A decode step built on a torch.compile'd layer function and its compile seconds."""
    prefill = prompt.shape[1]
    cfg = model.cfg
    h, kv, hd = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps, scale = model.layers[0].attn_norm.eps, model.layers[0].attn.scale

    def layer(x, n1, wqkv, wo, n2, wgu, wd, kbuf, vbuf, pos, mask, cos, signed):  # noqa: ANN001, ANN202
        b = x.shape[0]
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * n1
        q, k, v = F.linear(y, wqkv).view(b, 1, h + 2 * kv, hd).split([h, kv, kv], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + q.roll(hd // 2, -1) * signed
        k = k * cos + k.roll(hd // 2, -1) * signed
        kbuf.index_copy_(2, pos, k)
        vbuf.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(
            q, kbuf, vbuf, attn_mask=mask, scale=scale, enable_gqa=h != kv
        )
        x = x + F.linear(a.transpose(1, 2).reshape(b, 1, h * hd), wo)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * n2
        g, u = F.linear(y, wgu).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, wd)

    weights = []
    for blk in model.layers:
        a, f = blk.attn, blk.ffn
        weights.append((
            blk.attn_norm.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            a.o_proj.weight, blk.ffn_norm.weight,
            torch.cat([f.gate_proj.weight, f.up_proj.weight]), f.down_proj.weight,
        ))  # fmt: skip
    cache = model.new_cache()
    with torch.no_grad():
        model(prompt, cache=cache)
    kbufs = [torch.zeros(1, kv, SLOTS, hd) for _ in weights]
    vbufs = [torch.zeros(1, kv, SLOTS, hd) for _ in weights]
    for kb, vb, c in zip(kbufs, vbufs, cache.layers, strict=True):
        kb[:, :, :prefill], vb[:, :, :prefill] = c.k, c.v
    fn = torch.compile(layer, fullgraph=True, dynamic=False)
    state = {"p": prefill}

    @torch.no_grad()
    def step(ids: torch.Tensor) -> torch.Tensor:
        p = min(state["p"], SLOTS - 1)
        state["p"] += 1
        pos = torch.tensor([p])
        mask = (torch.arange(SLOTS) <= p).view(1, 1, 1, SLOTS)
        cos, sin = model.position.rotation(pos, torch.float32)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        x = F.embedding(ids, model.embed.weight)
        for w, kb, vb in zip(weights, kbufs, vbufs, strict=True):
            x = fn(x, *w, kb, vb, pos, mask, cos, signed)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * model.final_norm.weight
        return F.linear(x, model.lm_head.weight)

    t0 = time.perf_counter()
    step(prompt[:, -1:])
    took = time.perf_counter() - t0
    state["p"] = prefill
    return step, took


def load_lean_step(path: str) -> ModuleType:
    """The module in ``path`` (a lean_step.py), imported beside lmlab's own one."""
    spec = importlib.util.spec_from_file_location("lean_step_base", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"error: --lean-from {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def events(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return len(p.events())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--twin", action="store_true")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--prefill",
        type=int,
        default=64,
        help="cached tokens before the first step (smollm2_decode.py decodes from 128 to 384)",
    )
    ap.add_argument("--no-fuse", action="store_true", help="lmlab.nn.fused.ENABLED = False")
    ap.add_argument(
        "--lean-from",
        default=None,
        metavar="FILE",
        help="another checkout's lean_step.py (e.g. the main branch's), timed as 'lean_base'",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lmlab.nn.fused.ENABLED = not args.no_fuse
    model, _ = load(smollm2_path(), "cpu")
    if args.twin:
        cfg = copy.deepcopy(model.cfg)
        cfg.d_model, cfg.ffn.d_ff, cfg.vocab_size = 72, 96, 256
        torch.manual_seed(0)
        model = DecoderLM(cfg)
    model.eval()
    hf = None if args.quantize else hf_copy(model)
    if args.quantize:
        model = apply_quantization(model, args.quantize)
    torch.manual_seed(1)
    if not 0 < args.prefill <= SLOTS - args.steps - 2:
        raise SystemExit(f"--prefill must be in 1..{SLOTS - args.steps - 2}")
    prompt = torch.randint(0, 250, (1, args.prefill))
    x = prompt[:, -1:]
    steps: dict[str, Callable[[], torch.Tensor]] = {}
    with torch.no_grad():
        ref_cache, lean_cache = model.new_cache(), model.new_cache()
        model(prompt, cache=ref_cache)
        model(prompt, cache=lean_cache)
        print(f"lean_refusal: {lean_refusal(model, lean_cache)}")
        lean = LeanStep(model, lean_cache, SLOTS)
        steps["forward"] = lambda: model(x, cache=ref_cache, last_only=True).logits
        steps["lean"] = lambda: lean(x)  # the one-call C++ step where it applies
        py_cache = model.new_cache()
        model(prompt, cache=py_cache)
        lean_py = LeanStep(model, py_cache, SLOTS)

        def python_loop() -> torch.Tensor:
            with decode_kernel.disabled():
                return lean_py(x)

        steps["lean_py"] = python_loop  # the lean step's Python loop (A/B of the C++ step)
        if args.lean_from:
            base_cache = model.new_cache()
            model(prompt, cache=base_cache)
            base = load_lean_step(args.lean_from).LeanStep(model, base_cache, SLOTS)
            steps["lean_base"] = lambda: base(x)
        if hf is not None:
            pkv = hf(prompt, use_cache=True).past_key_values
            steps["transformers"] = lambda: (
                hf(x, past_key_values=pkv, use_cache=True, logits_to_keep=1).logits
            )
        got = steps["lean"]()  # every contender's first step, at the same position
        diff = (steps["forward"]() - got).abs().max().item()
        print(f"lean vs forward, largest |logit difference|: {diff:.3g} (C++ step: "
              f"{lean.cpp_refusal or decode_kernel.status()})")  # fmt: skip
        if "lean_base" in steps:
            bdiff = (steps["lean_base"]() - got).abs().max().item()
            print(f"lean vs lean_base, largest |logit difference|: {bdiff:.3g}")
        if args.compile:
            cstep, took = compiled_step(model, prompt)
            check = model.new_cache()
            model(prompt, cache=check)
            cdiff = (cstep(x) - model(x, cache=check, last_only=True).logits).abs().max().item()
            print(f"compiled layer step: {took:.1f} s to compile, largest |logit difference| "
                  f"from the forward {cdiff:.3g}")  # fmt: skip
            steps["compiled"] = lambda: cstep(x)
        for name in ("forward", "lean", "lean_py", "lean_base", "compiled"):
            if name in steps:
                print(f"profiler events per step, {name}: {events(steps[name])}")
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(
            f"{name:>12}: best {1e3 * min(ts):.2f} ms, median {1e3 * statistics.median(ts):.2f} ms"
        )
    best = {name: min(ts) for name, ts in times.items()}
    anchor = "transformers" if "transformers" in best else "forward"
    for name in best:
        if name != anchor:
            print(f"step {anchor}/{name} = {best[anchor] / best[name]:.2f}x (best of {args.steps})")
    # the benchmark's tokens/s divide by the mean step, not the best: medians beside the bests
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name in med:
        if name != anchor:
            print(f"step {anchor}/{name} = {med[anchor] / med[name]:.2f}x (median of {args.steps})")


if __name__ == "__main__":
    main()
