"""lmlab's float32 matrix-vector product (lmlab.nn.decode_kernel.gemv) against torch.mm on
SmolLM2-135M's decode shapes, with the weights streamed from memory as in a decode step.

A pass walks 30 layers' (N, K) weights in decode order (fused q/k/v 960x576, o 576x576, fused
gate/up 3072x576, down 576x1536) and then the 49152x576 head: 538 MB, more than the caches, so
each product reads its weight from memory as decode does. Each pass walks the weights once with
lmlab's product (the library call, no Python wrapper) and once with torch.mm (``out=``, into a
preallocated tensor), alternating which goes first; the per-shape totals are summed over passes
and the ratio torch / lmlab printed per shape (> 1: lmlab faster) with lmlab's GB/s.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/decode_gemv.py [--rows 1] [--passes 5]

Results and conditions: docs/decoding.md (quoted there with the load).
"""

from __future__ import annotations

import argparse
import time

import torch

from lmlab.nn import decode_kernel

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}  # fmt: skip
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1, help="rows of x (1..8)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not decode_kernel.available():
        raise SystemExit(f"lmlab's decode kernels are not available: {decode_kernel.status()}")
    torch.manual_seed(0)
    weights = [
        (name, torch.randn(n, k) * 0.02)
        for _ in range(args.layers)
        for name, (n, k) in SHAPES.items()
    ]
    weights.append(("head 49152x576", torch.randn(*HEAD) * 0.02))
    xs = {k: torch.randn(args.rows, k) for k in {w.shape[1] for _, w in weights}}
    ys = {n: torch.empty(args.rows, n) for n in {w.shape[0] for _, w in weights}}
    lib = decode_kernel._lib.lib
    assert lib is not None
    mine: dict[str, float] = {}
    theirs: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    worst = 0.0
    for p in range(args.passes + 1):  # pass 0 warms up
        # each pass walks the whole 538 MB once per implementation (which goes first
        # alternates), so every product reads its weight from memory, not from the other's run
        for which in (0, 1) if p % 2 else (1, 0):
            d = mine if which == 0 else theirs
            for name, w in weights:
                x, y = xs[w.shape[1]], ys[w.shape[0]]
                t0 = time.perf_counter()
                if which == 0:  # the library call itself, as the decode step makes it
                    lib.lmlab_gemv(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                                   y.data_ptr())  # fmt: skip
                else:
                    torch.mm(x, w.t(), out=y)
                dt = time.perf_counter() - t0
                if p:
                    d[name] = d.get(name, 0.0) + dt
                    if which == 0:
                        nbytes[name] = nbytes.get(name, 0) + w.nbytes
                        worst = max(worst, (y - torch.mm(x, w.t())).abs().max().item())
                        y.zero_()
    print(f"rows {args.rows}, threads {torch.get_num_threads()}, {args.passes} passes, "
          f"{decode_kernel.status()}; max |lmlab - torch| {worst:.2e}")  # fmt: skip
    for name in mine:
        gbs = nbytes[name] / mine[name] / 1e9
        print(f"{name:18s} lmlab {mine[name] * 1e3 / args.passes:8.2f} ms/pass  torch "
              f"{theirs[name] * 1e3 / args.passes:8.2f} ms/pass  torch/lmlab "
              f"{theirs[name] / mine[name]:.3f}x  lmlab {gbs:5.1f} GB/s")  # fmt: skip
    tm, tt = sum(mine.values()), sum(theirs.values())
    print(f"{'all':18s} lmlab {tm * 1e3 / args.passes:8.2f} ms/pass  torch "
          f"{tt * 1e3 / args.passes:8.2f} ms/pass  torch/lmlab {tt / tm:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
