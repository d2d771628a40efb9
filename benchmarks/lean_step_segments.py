"""Where SmolLM2-135M's lean decode step spends the time between its matrix products.

The step's Python loop (lmlab.generation.lean_step, with the one-call C++ step of
lmlab.nn.decode_kernel switched off) is timed segment by segment: from the end of one linear
layer's product to the start of the next (what follows the fused q/k/v product: RoPE, the KV
write and attention; the o product: residual add and norm; gate/up: SiLU and product; down:
residual add and norm), averaged over a step's 30 layers, best over ``--steps`` steps. Each step
runs twice, interleaved: ``real`` (the products run) and ``warm`` (each product replaced by a
copy of a stored output of the same shape, so no weights stream through the caches). The same
operations take longer after a real product: the sum of the segments (``between``) against the
products' own time says how much of a step is outside them, and ``warm`` how much of that is
the operations themselves.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lean_step_segments.py --threads 2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from quantized_quality import smollm2_path  # benchmarks/ is on sys.path

import lmlab.generation.lean_step as lean_step
from lmlab.interop.load import load
from lmlab.nn import decode_kernel
from lmlab.nn.quant import apply_quantization

NAMES = ("after q/k/v", "after o", "after gate/up", "after down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--quantize", default=None, help="e.g. int4+a8 (lmlab.nn.quant spec)")
    args = ap.parse_args()
    decode_kernel.ENABLED = False  # the segments are those of the Python loop
    torch.set_num_threads(args.threads)
    model, _ = load(smollm2_path(), "cpu")
    model.eval()
    if args.quantize:
        model = apply_quantization(model, args.quantize)
    torch.manual_seed(1)
    prompt = torch.randint(0, 250, (1, args.prefill))
    x = prompt[:, -1:]
    real = lean_step._lin
    state: dict[str, Any] = {"i": 0, "t": 0.0, "in": 0.0}
    seg: list[float] = [0.0] * 4
    outs: dict[tuple[int, int], torch.Tensor] = {}

    def timed(fake: bool) -> Any:
        def lin(op: Any, h: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            i = state["i"]
            if i:
                seg[(i - 1) % 4] += t - state["t"]
            if fake:
                y0 = real(op, h) if (h.shape[0], i) not in outs else outs[(h.shape[0], i)]
                outs[(h.shape[0], i)] = y0
                y = y0.clone()
            else:
                y = real(op, h)
            state["i"] = i + 1
            state["t"] = time.perf_counter()
            state["in"] += state["t"] - t
            return y

        return lin

    best: dict[str, list[float]] = {}
    with torch.no_grad():
        cache = model.new_cache()
        model(prompt, cache=cache)
        lean = lean_step.LeanStep(model, cache, args.prefill + 2 * args.steps + 8)
        for mode in ("warm", "real"):  # fill the stored outputs once
            lean_step._lin = timed(mode == "warm")
            lean(x)
        for _ in range(args.steps):
            for mode in ("real", "warm"):
                lean_step._lin = timed(mode == "warm")
                seg[:] = [0.0] * 4
                state.update(i=0, t=0.0, **{"in": 0.0})
                t0 = time.perf_counter()
                lean(x)
                total = time.perf_counter() - t0
                row = [*seg, state["in"], total - state["in"], total]
                old = best.setdefault(mode, row)
                best[mode] = [min(a, b) for a, b in zip(old, row, strict=True)]
        lean_step._lin = real
    n = len(model.layers)
    print(f"threads {args.threads}, prefill {args.prefill}, {args.quantize or 'float32'}, best of "
          f"{args.steps} (per layer: a segment's sum over the step / {n})")  # fmt: skip
    for mode, row in best.items():
        cells = ", ".join(
            f"{name} {1e6 * v / n:.0f} us" for name, v in zip(NAMES, row, strict=False)
        )
        print(f"{mode:>5}: {cells}; products {1e3 * row[4]:.2f} ms, between {1e3 * row[5]:.2f} "
              f"ms, step {1e3 * row[6]:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
