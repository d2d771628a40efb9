"""Batch-1 linear layers of SmolLM2-135M's shapes: float32 ``F.linear`` vs lmlab's C++ int8/int4
kernels (lmlab.nn.quant_kernel) vs PyTorch's CPU kernels, interleaved in one process.

Each shape (N out, K in: 576x576 q/o, 192x576 k/v, 1536x576 gate/up, 576x1536 down, 49152x576
head) gets enough independent copies that one pass over them reads at least ``--mib`` MiB of
quantized weights, more than the last-level cache, so every call reads its weight from memory as
in decode (``--hot``: one copy, from cache). Each round times every method once (best of
``--repeats`` passes over the copies, the order rotated per round); the best round is reported as
microseconds per call, GB/s of weight bytes read (codes + scales + zeros; float32: 4 bytes per
weight) and the speed-up over float32.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/quant_kernel_ab.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmlab.nn import quant_kernel
from lmlab.nn.quant import QuantLinear

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def methods(n: int, k: int, copies: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one pass over the copies, weight bytes that pass reads)."""
    torch.manual_seed(0)
    x = torch.randn(1, k)
    lins = [torch.nn.Linear(k, n, bias=False) for _ in range(copies)]
    q8 = [QuantLinear(lin, 8, None, True, False) for lin in lins]
    q4 = [QuantLinear(lin, 4, 32, False, False) for lin in lins]
    ws = [lin.weight.detach() for lin in lins]
    out: dict[str, tuple[Callable[[], object], int]] = {
        "float32": (lambda: [F.linear(x, w) for w in ws], sum(w.nbytes for w in ws)),
    }
    b8, b4 = sum(q.weight_bytes() for q in q8), sum(q.weight_bytes() for q in q4)
    if quant_kernel.available():
        out["lmlab int8"] = (
            lambda: [quant_kernel.int8_mm(x, q.qweight, q.scales, k) for q in q8],
            b8,
        )
        out["lmlab int4"] = (
            lambda: [quant_kernel.int4_mm(x, q.qweight, q.scales, q.zeros, 32) for q in q4],
            b4,
        )
        out["lmlab int8+a8"] = (
            lambda: [quant_kernel.int8_mm(x, q.qweight, q.scales, k, act_bits=8) for q in q8],
            b8,
        )
        out["lmlab int4+a8"] = (
            lambda: [
                quant_kernel.int4_mm(x, q.qweight, q.scales, q.zeros, 32, act_bits=8) for q in q4
            ],
            b4,
        )
    mm8, mm4 = torch.ops.aten._weight_int8pack_mm, torch.ops.aten._weight_int4pack_mm_for_cpu
    out["torch int8"] = (lambda: [mm8(x, q.qweight, q.scales[:, 0]) for q in q8], b8)
    out["torch int4"] = (lambda: [mm4(x, q._packed, 32, q._sz) for q in q4], b4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mib", type=int, default=96, help="quantized MiB per pass (> the LLC)")
    ap.add_argument("--hot", action="store_true", help="one copy: weights from cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ok = quant_kernel.available()
    print(f"lmlab C++ kernels: {quant_kernel.status()} ({time.perf_counter() - t0:.1f} s to load)")
    report = []
    for n, k in SHAPES:
        int4_bytes = n * k // 2 + 8 * n * k // 32
        copies = 1 if args.hot else max(1, -(-args.mib * 2**20 // int4_bytes))
        ms = methods(n, k, copies)
        best = {name: float("inf") for name in ms}
        names = list(ms)
        with torch.no_grad():
            for f, _ in ms.values():
                f()  # warm-up
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        ms[name][0]()
                        best[name] = min(best[name], (time.perf_counter() - t) / copies)
        row = {"shape": f"{n}x{k}", "copies": copies}
        parts = []
        for name in names:
            gbs = ms[name][1] / copies / best[name] / 1e9
            ratio = best["float32"] / best[name]
            row[name] = {"us": best[name] * 1e6, "gb_s": gbs, "vs_float32": ratio}
            parts.append(f"{name} {best[name] * 1e6:,.0f} us {gbs:.1f} GB/s {ratio:.2f}x")
        print(f"{n:>5}x{k:<5} ({copies} copies): " + " | ".join(parts))
        report.append(row)
    print(json.dumps({"threads": args.threads, "hot": args.hot, "kernels": ok, "rows": report}))


if __name__ == "__main__":
    main()
