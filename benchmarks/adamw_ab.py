"""AdamW's step alone on a model's parameters: lmlab's one-call step
(:class:`lmlab.training.optim.AdamW`, ``torch.ops.lmlab.adamw_step_``) against torch's
``AdamW(fused=True)`` (what it replaces) and torch's ``foreach`` AdamW, interleaved in one process
(a random order each round), medians; then whether the three ended with the same weights.

    python benchmarks/adamw_ab.py [--shape nanogpt|minigpt] [--rounds 300] [--threads 2]

The parameters are lmlab's default model at that shape (``train_step_ab.py``'s shapes: nanoGPT's
CPU shape has 51 parameters, 0.8M elements), in the trainer's two groups (decay on matrices),
each optimizer with its own copy; gradients stay the same between steps (warm in cache, as a
backward pass leaves them)."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_ab import interleaved_medians  # noqa: E402

from lmlab.config import load_config
from lmlab.models.build import build_model
from lmlab.training import optim

SHAPES = {"nanogpt": (4, 128, 4, 64), "minigpt": (6, 256, 4, 256)}  # layers, d, heads, ctx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="nanogpt",
        help="the default model's shape (default nanogpt: 4 layers, d 128; minigpt: 6, d 256)",
    )
    ap.add_argument(
        "--rounds", type=int, default=300, help="interleaved steps of each (default 300)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lmlab.nn import train_kernel

    if not train_kernel.available():
        raise SystemExit(f"lmlab's training kernels are not available: {train_kernel.status()}")
    layers, d, heads, ctx = SHAPES[args.shape]
    over = [f"model.n_layers={layers}", f"model.d_model={d}", f"model.attention.n_heads={heads}"]
    cfg = load_config(None, [*over, f"model.max_seq_len={ctx}", "model.vocab_size=65"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    kinds = {
        "lmlab": (optim.AdamW, {"fused": True}),
        "torch fused": (torch.optim.AdamW, {"fused": True}),
        "torch foreach": (torch.optim.AdamW, {"foreach": True}),
    }
    grads = {k: torch.randn_like(p) * 1e-3 for k, p in model.named_parameters()}
    opts = {}
    for name, (cls, kw) in kinds.items():
        m = copy.deepcopy(model)  # the same weights and gradients, each its own copy
        for k, p in m.named_parameters():
            p.grad = grads[k].clone()
        groups = optim.param_groups(m, cfg.train.weight_decay)
        opts[name] = (m, cls(groups, lr=cfg.train.lr, betas=(0.9, 0.95), **kw))
    n = sum(p.numel() for p in model.parameters())
    for _, opt in opts.values():
        for _ in range(5):  # the first step creates the state (torch's step for all three)
            opt.step()
    med = interleaved_medians({name: opt.step for name, (_, opt) in opts.items()}, args.rounds)
    count = len(list(model.parameters()))
    print(
        f"AdamW step, {args.shape} shape ({count} parameters, {n:,} elements), "
        f"{args.threads} thread(s), {args.rounds} rounds: "
        + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in med.items())
    )
    for other in ("torch fused", "torch foreach"):
        print(f"adamw step lmlab/{other} = {med[other] / med['lmlab']:.2f}x")
    ref = dict(opts["torch fused"][0].named_parameters())
    for name in ("lmlab", "torch foreach"):
        same = all(torch.equal(p, ref[k]) for k, p in opts[name][0].named_parameters())
        print(f"{name} weights equal to torch fused's after {args.rounds + 5} steps: {same}")


if __name__ == "__main__":
    main()
