"""Training throughput ratios on this machine, measured side by side in one process.

    python benchmarks/train_speed.py [--config configs/minigpt.yaml] [--steps 8]

Times optimizer steps of the same model on the same batches in four settings (fp32 / bf16
autocast, eager / torch.compile) and prints tokens/s, MFU against the measured matmul peak, and
each setting's speed relative to fp32 eager. Not part of the test suite: timings are noisy on
shared machines, ratios less so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmlab.config import load_config
from lmlab.models import build_model
from lmlab.training.flops import flops_per_token
from lmlab.training.hardware import autocast, measure_matmul_peak
from lmlab.training.optim import build_optimizer


def time_steps(cfg, precision: str, compile_model: bool, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.train)
    fwd = torch.compile(model) if compile_model else model
    seq = cfg.train.seq_len or cfg.model.max_seq_len
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, seq))
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        with autocast(torch.device("cpu"), precision):
            loss = fwd(x, targets=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # skip warm-up (and compilation)
            times.append(time.perf_counter() - t)
    return cfg.train.batch_size * seq / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/minigpt.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    cfg.model.vocab_size = cfg.model.vocab_size or 65
    model = build_model(cfg.model)
    flops = flops_per_token(model, cfg.model, cfg.train.seq_len or cfg.model.max_seq_len)
    settings = [("fp32", False), ("bf16", False)]
    if not args.no_compile:
        settings += [("fp32", True), ("bf16", True)]
    peaks = {p: measure_matmul_peak(torch.device("cpu"), p, seconds=1.0) for p in ("fp32", "bf16")}
    base = None
    print(f"{'setting':<22}{'tokens/s':>10}{'MFU':>8}{'vs fp32 eager':>15}")
    for precision, comp in settings:
        tok_s = time_steps(cfg, precision, comp, args.steps)
        peak = peaks[precision]
        base = base or tok_s
        name = f"{precision} {'compiled' if comp else 'eager'}"
        print(f"{name:<22}{tok_s:>10,.0f}{100 * flops * tok_s / peak:>7.1f}%{tok_s / base:>14.2f}x")


if __name__ == "__main__":
    main()
