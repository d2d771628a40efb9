"""Batch-1 linear layers of SmolLM2-135M's shapes: float32 ``F.linear`` vs lmlab's C++ int8/int4
kernels (lmlab.nn.quant_kernel) vs PyTorch's CPU kernels, interleaved in one process.

Each shape (N out, K in: 576x576 q/o, 192x576 k/v, 960x576 the lean step's fused q/k/v, 1536x576
gate/up, 3072x576 fused gate/up, 576x1536 down, 49152x576 head) gets enough independent copies
that one pass over them reads at least ``--mib`` MiB of quantized weights, more than the cores'
L2, so every call reads its weight from L3 or memory as in decode (``--hot``: one copy, from
cache). Each round times every method once (best of ``--repeats`` passes over the copies, the
order rotated per round); the best round is reported as microseconds per call, GB/s of weight
bytes read (codes + scales + zeros; float32: 4 bytes per weight) and the speed-up over float32.
lmlab's kernels are called through ctypes with their arguments bound once (the output
preallocated): the kernel's own time plus ~1 us of ctypes per call, what a C++ caller pays
(Python's ``quant_kernel.run`` adds several us per call on top). The
default 96 MiB of copies is less than this VM's 480 MiB L3, as decode's ~101 MB of int4 weights
is, so these rates can exceed the 512 MiB ``torch.sum`` of benchmarks/quantized_decode.py's read
bandwidth; ``--mib 512`` reads from DRAM. That bandwidth is measured before and after the shapes
(the better of the two, same threads) and each lmlab method's rates are printed as a fraction of
it at the end. ``--baseline FILE``: another version of quant_kernels.cpp (``git show
main:src/lmlab/nn/quant_kernels.cpp > /tmp/base.cpp``) built with the same flags, its methods
(``base int4+a8`` ...) timed in the same rounds: a before/after A/B in one process.

    OMP_NUM_THREADS=2 nice -n 10 .venv/bin/python benchmarks/quant_kernel_ab.py --threads 2 \
        --only "lmlab int4+a8" "lmlab int4" "lmlab int8"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lmlab.nn import quant_kernel
from lmlab.nn.quant import QuantLinear

SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)]


def methods(
    n: int, k: int, copies: int, libs: dict[str, ctypes.CDLL]
) -> dict[str, tuple[Callable[[], object], int]]:
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
    y = torch.empty(1, n)
    xp, yp = x.data_ptr(), y.data_ptr()

    def bound(fn: Callable[..., int], calls: list[tuple]) -> Callable[[], object]:
        held = (x, y, q8, q4)  # the tensors behind the bound pointers stay alive
        return lambda: [fn(*c) for c in calls] and held

    for label, lib in libs.items():
        a8, i4, i8 = lib.lmlab_a8_mm, lib.lmlab_int4_mm, lib.lmlab_int8_mm
        p8 = [(q.qweight.data_ptr(), q.scales.data_ptr()) for q in q8]
        p4 = [(q.qweight.data_ptr(), q.scales.data_ptr(), q.zeros.data_ptr()) for q in q4]
        out[f"{label} int8"] = (bound(i8, [(xp, 1, k, w, s, n, k, yp) for w, s in p8]), b8)
        out[f"{label} int4"] = (bound(i4, [(xp, 1, k, w, s, z, n, 32, yp) for w, s, z in p4]), b4)
        out[f"{label} int8+a8"] = (bound(a8, [(8, xp, 1, k, w, s, s, n, k, yp) for w, s in p8]), b8)
        out[f"{label} int4+a8"] = (
            bound(a8, [(4, xp, 1, k, w, s, z, n, 32, yp) for w, s, z in p4]),
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
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="FILE",
        help="another quant_kernels.cpp: its kernels timed in the same rounds (base ...)",
    )
    ap.add_argument(
        "--only", nargs="*", help="methods to time (float32 always runs: the ratios' base)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ok = quant_kernel.available()
    print(f"lmlab C++ kernels: {quant_kernel.status()} ({time.perf_counter() - t0:.1f} s to load)")
    libs = {"lmlab": quant_kernel._kernels.lib} if ok and quant_kernel._kernels.lib else {}
    if args.baseline and ok:
        libs["base"] = quant_kernel._build(source=args.baseline)
        print(f"baseline kernels: {args.baseline}")
    from quantized_decode import read_bandwidth  # benchmarks/ is on sys.path

    bandwidth = read_bandwidth()
    report = []
    for n, k in SHAPES:
        int4_bytes = n * k // 2 + 8 * n * k // 32
        copies = 1 if args.hot else max(1, -(-args.mib * 2**20 // int4_bytes))
        ms = methods(n, k, copies, libs)
        if args.only:  # "lmlab int4+a8" keeps "base int4+a8" too
            keep = {"float32", *args.only, *(f"base {o.removeprefix('lmlab ')}" for o in args.only)}
            ms = {name: v for name, v in ms.items() if name in keep}
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
    bandwidth = max(bandwidth, read_bandwidth())
    for row in report:
        for name in row:
            if isinstance(row[name], dict):
                row[name]["bandwidth_fraction"] = row[name]["gb_s"] * 1e9 / bandwidth
    print(f"read bandwidth ({args.threads} threads, 512 MiB torch.sum): {bandwidth / 1e9:.1f} GB/s")
    for name in (m for m in report[0] if m.startswith(("lmlab", "base"))):
        fr = ", ".join(f"{r['shape']} {100 * r[name]['bandwidth_fraction']:.0f}%" for r in report)
        print(f"{name} as a fraction of it: {fr}")
    print(json.dumps({"threads": args.threads, "hot": args.hot, "kernels": ok,
                      "bandwidth_gb_s": bandwidth / 1e9, "rows": report}))  # fmt: skip


if __name__ == "__main__":
    main()
