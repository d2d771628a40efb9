"""What the unhooked hook points cost a forward pass (lmlab.hooks; not a timed test).

Interleaved A/B in one process on the same model and input: A is the model as built (every
HookPoint in place, none registered); B is the same model with every HookPoint replaced by a
plain identity function in its parent's instance dict (the cheapest stand-in a call site can
have short of deleting the call; the attention core's one "scores or pattern hooked?" check
runs in both arms). Prints the median forward time of each and the ratio A / B
for a tiny model (where Python overhead dominates, the worst case) and a small one.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/hooks_overhead.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmlab.config import config_from_dict
from lmlab.models import build_model
from lmlab.nn.hooks import HookPoint

SIZES = {
    "tiny d=32 L=2 T=16": (dict(d_model=32, n_layers=2, attention={"n_heads": 4}), 16),
    "small d=256 L=4 T=128": (dict(d_model=256, n_layers=4, attention={"n_heads": 8}), 128),
}


def build(model_fields: dict, seq: int) -> torch.nn.Module:
    data = {"model": dict(model_fields, max_seq_len=seq), "train": {"device": "cpu"}}
    cfg = config_from_dict(data).validate().model
    cfg.vocab_size = 512
    torch.manual_seed(0)
    return build_model(cfg).eval()


def _identity():
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    identity.fns = ()  # type: ignore[attr-defined]  # the attention core's "any hook?" check
    return identity


def stub_out(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, HookPoint]]:
    """Shadow every HookPoint attribute with an identity function; returns what to restore."""
    stubbed = []
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, HookPoint):
                stand_in = _identity()
                object.__setattr__(parent, name, stand_in)  # found before Module.__getattr__
                stubbed.append((parent, name, child))
    return stubbed


def restore(stubbed: list[tuple[torch.nn.Module, str, HookPoint]]) -> None:
    """Put the hook points back as the model holds them (lmlab.nn.hooks.fast_hook_lookup)."""
    for parent, name, point in stubbed:
        object.__setattr__(parent, name, point)


def time_forward(model: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        model(x)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    for label, (fields, seq) in SIZES.items():
        model = build(fields, seq)
        x = torch.randint(0, 512, (2, seq))
        reps = 100 if seq <= 16 else 5
        with torch.no_grad():
            ref = model(x).logits
            stubbed = stub_out(model)
            assert torch.equal(model(x).logits, ref)  # the stand-ins change nothing
            restore(stubbed)
            a: list[float] = []
            b: list[float] = []
            time_forward(model, x, reps)  # warm-up
            for r in range(args.rounds):  # ABBA order: drift hits both arms alike
                if r % 2:
                    stubbed = stub_out(model)
                    b.append(time_forward(model, x, reps))
                    restore(stubbed)
                a.append(time_forward(model, x, reps))
                if not r % 2:
                    stubbed = stub_out(model)
                    b.append(time_forward(model, x, reps))
                    restore(stubbed)
        ma, mb = statistics.median(a), statistics.median(b)
        best = min(a) / min(b)
        n = len(stubbed)
        print(
            f"{label}: {n} hook points; hooked-off {ma * 1e3:.3f} ms, stubbed {mb * 1e3:.3f} ms, "
            f"ratio {ma / mb:.4f} (best-of ratio {best:.4f}; "
            f"{(ma - mb) / n * 1e9:+.0f} ns per point)"
        )


if __name__ == "__main__":
    main()
