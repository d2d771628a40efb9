"""local_global attention, dense masked formula vs the block-sparse path, side by side.

    python benchmarks/local_global_sparse.py [--lengths 1024 2048 4096] [--repeats 5]

One attention call (the attention core, :func:`lmlab.nn.attention_core.attend`) of batch 1,
d_model 64 = 4 heads of 16, window 128, 1 global token, float32, on one CPU thread, for each
length T: the dense path (the mask built and applied to every T x T score; ``sdpa`` and
``math`` backends) and the sparse path (:func:`lmlab.nn.local_global.local_global_sparse`).
Prints per T: score elements computed, peak bytes allocated during the forward (torch
profiler memory events, running sum), bytes autograd keeps for backward (saved-tensor hooks),
median forward seconds over interleaved repeats, and the dense / sparse ratios. Not part of the
test suite: timings are noisy on shared machines, ratios less so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from lmlab.nn.attention_core import attend, attention_math, attention_sdpa
from lmlab.nn.local_global import LocalGlobalMask, sparse_applies

H, HD, WINDOW, GLOBAL = 4, 16, 128, 1


def inputs(t: int, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, H, t, HD, generator=gen, requires_grad=grad) for _ in range(3))
    return q, k, v


def runners(t: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]]:
    mask = LocalGlobalMask(GLOBAL, 0)

    def dense_mask(tq: int, s: int, device=None, window=None) -> torch.Tensor:
        return mask(tq, s, device, window)  # the same mask without its sparse hook

    def call(backend, mask_fn):
        def run(q, k, v):
            return attend(q, k, v, backend=backend, scale=HD**-0.5, mask_fn=mask_fn, window=WINDOW)

        return run

    return {
        "dense sdpa": call(attention_sdpa, dense_mask),
        "dense math": call(attention_math, dense_mask),
        "sparse": call(attention_sdpa, mask),
    }


def score_elements(t: int, name: str) -> int:
    """Scores computed per call: T x T dense; band (bq + window - 1 per query, bq = window),
    global columns and global rows sparse."""
    if name != "sparse" or not sparse_applies(t, WINDOW, True):  # below 8 window: dense
        return H * t * t
    ell = min(t, WINDOW) + WINDOW - 1
    return H * (t * (ell + GLOBAL) + GLOBAL * t)


def peak_bytes(run, t: int) -> int:
    """Peak bytes held during one forward (no grad): the running sum, in start-time order, of
    every profiler event's own allocations minus frees (op granularity: a buffer allocated and
    freed inside one op is not seen)."""
    q, k, v = inputs(t)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        run(q, k, v)
    level = peak = 0
    for e in sorted(p.events(), key=lambda e: e.time_range.start):
        level += e.self_cpu_memory_usage
        peak = max(peak, level)
    return peak


def saved_bytes(run, t: int) -> int:
    """Bytes autograd keeps for backward in one forward (q, k, v themselves excluded)."""
    q, k, v = inputs(t, grad=True)
    own = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        run(q, k, v)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, B=1 H={H} hd={HD} window={WINDOW} g={GLOBAL}")
    for t in args.lengths:
        run = runners(t)
        q, k, v = inputs(t)
        ref = run["dense math"](q, k, v)[0]  # type: ignore[index]
        err = (run["sparse"](q, k, v)[0] - ref).abs().max().item()  # type: ignore[index]
        times: dict[str, list[float]] = {name: [] for name in run}
        with torch.no_grad():
            for _ in range(args.repeats):  # interleaved: every setting once per round
                for name, fn in run.items():
                    start = time.perf_counter()
                    fn(q, k, v)
                    times[name].append(time.perf_counter() - start)
        print(f"\nT={t}  (sparse vs dense math: max |diff| {err:.1e})")
        print(f"{'path':<11} {'scores':>11} {'peak fwd MiB':>13} {'saved MiB':>10} {'fwd s':>8}")
        rows = {}
        for name, fn in run.items():
            rows[name] = (
                score_elements(t, name),
                peak_bytes(fn, t) / 2**20,
                saved_bytes(fn, t) / 2**20,
                statistics.median(times[name]),
            )
            s, pk, sv, sec = rows[name]
            print(f"{name:<11} {s:>11,} {pk:>13.1f} {sv:>10.1f} {sec:>8.4f}")
        for dense in ("dense sdpa", "dense math"):
            d, sp = rows[dense], rows["sparse"]
            print(
                f"{dense} / sparse: scores {d[0] / sp[0]:.1f}x, peak {d[1] / sp[1]:.1f}x, "
                f"saved {d[2] / max(sp[2], 1e-9):.1f}x, time {d[3] / sp[3]:.2f}x"
            )


if __name__ == "__main__":
    main()
