"""SwiGLU's silu(gate) * up alone, forward and backward: lmlab's one-pass operator
(``torch.ops.lmlab.silu_mul_bf16``) against torch's ``F.silu(gate) * up``, bf16, interleaved in
one process (a random order each round), medians.

    python benchmarks/silu_mul_ab.py [--rows 4096] [--cols 704] [--rounds 200] [--threads 2]

The default shape is ``configs/llama.yaml``'s: 16 x 256 tokens, d_ff 704."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_ab import interleaved_medians  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=704)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lmlab.nn import train_kernel

    if not train_kernel.available():
        raise SystemExit(f"lmlab's training kernels are not available: {train_kernel.status()}")
    torch.manual_seed(0)
    shape = (args.rows, args.cols)
    gate = torch.randn(shape).bfloat16().requires_grad_()
    up = torch.randn(shape).bfloat16().requires_grad_()
    g = torch.randn(shape).bfloat16()

    def lmlab() -> None:
        torch.ops.lmlab.silu_mul_bf16(gate, up).backward(g)

    def torch_ops() -> None:
        (F.silu(gate) * up).backward(g)

    fns = {"lmlab": lmlab, "torch": torch_ops}
    for fn in fns.values():
        for _ in range(10):
            fn()

    def clear() -> None:
        gate.grad = up.grad = None

    med = interleaved_medians(fns, args.rounds, clear)
    print(
        f"silu(gate) * up, forward + backward, bf16 {shape}, {args.threads} thread(s): "
        f"lmlab {1e3 * med['lmlab']:.3f} ms, torch {1e3 * med['torch']:.3f} ms, "
        f"lmlab/torch = {med['torch'] / med['lmlab']:.2f}x"
    )


if __name__ == "__main__":
    main()
