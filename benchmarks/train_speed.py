"""Training throughput ratios on this machine, measured side by side in one process.

    python benchmarks/train_speed.py [--config configs/minigpt.yaml] [--steps 8]
        [--device cpu|cuda] [--batch-size N] [--no-compile] [--only bf16-eager,bf16-compiled]

Times optimizer steps of the same model on the same batches in four settings (fp32 / bf16
autocast, eager / torch.compile) and prints tokens/s, MFU against the measured matmul peak, and
each setting's speed relative to fp32 eager. Not part of the test suite: timings are noisy on
shared machines, ratios less so. ``--device cuda`` (benchmarks/gpu_check.sh) times the same steps
on the GPU, synchronising before each clock read; ``--batch-size`` overrides the config's;
``--only`` times only the named settings (the ratio column is then against the first of them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmlab.config import load_config
from lmlab.models import build_model
from lmlab.training.flops import flops_per_token
from lmlab.training.hardware import _device_name, autocast, measure_matmul_peak, synchronize
from lmlab.training.optim import build_optimizer


def time_steps(
    cfg, precision: str, compile_model: bool, steps: int, device: torch.device | None = None
) -> float:
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    opt = build_optimizer(model, cfg.train)
    fwd = torch.compile(model) if compile_model else model
    seq = cfg.train.seq_len or cfg.model.max_seq_len
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, seq)).to(device)
    times = []
    for i in range(steps + 2):
        synchronize(device)
        t = time.perf_counter()
        with autocast(device, precision):
            loss = fwd(x, targets=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        if i >= 2:  # skip warm-up (and compilation)
            times.append(time.perf_counter() - t)
    return cfg.train.batch_size * seq / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/minigpt.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    ap.add_argument("--only", default=None, help="comma-separated settings, e.g. bf16-eager")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = load_config(args.config)
    cfg.model.vocab_size = cfg.model.vocab_size or 65
    if args.batch_size:
        cfg.train.batch_size = args.batch_size
    model = build_model(cfg.model)
    flops = flops_per_token(model, cfg.model, cfg.train.seq_len or cfg.model.max_seq_len)
    settings = [("fp32", False), ("bf16", False)]
    if not args.no_compile:
        settings += [("fp32", True), ("bf16", True)]
    if args.only:
        names = {
            f"{p}-{'compiled' if c else 'eager'}": (p, c) for p in ("fp32", "bf16") for c in (0, 1)
        }
        unknown = [n for n in args.only.split(",") if n not in names]
        if unknown:
            ap.error(f"--only: unknown setting(s) {unknown}; choose from {sorted(names)}")
        settings = [(names[n][0], bool(names[n][1])) for n in args.only.split(",")]
    peaks = {p: measure_matmul_peak(device, p, seconds=1.0) for p in ("fp32", "bf16")}
    seq = cfg.train.seq_len or cfg.model.max_seq_len
    print(
        f"device {device} ({_device_name(device)})"
        f", batch {cfg.train.batch_size} x {seq} tokens, {flops / 1e6:.1f} MFLOP/token, matmul "
        f"peak fp32 {peaks['fp32'] / 1e12:.1f} / bf16 {peaks['bf16'] / 1e12:.1f} TFLOP/s"
    )
    base = None
    first = f"{settings[0][0]} {'compiled' if settings[0][1] else 'eager'}"
    print(f"{'setting':<22}{'tokens/s':>10}{'MFU':>8}{'vs ' + first:>15}")
    for precision, comp in settings:
        tok_s = time_steps(cfg, precision, comp, args.steps, device)
        peak = peaks[precision]
        base = base or tok_s
        name = f"{precision} {'compiled' if comp else 'eager'}"
        print(f"{name:<22}{tok_s:>10,.0f}{100 * flops * tok_s / peak:>7.1f}%{tok_s / base:>14.2f}x")


if __name__ == "__main__":
    main()
