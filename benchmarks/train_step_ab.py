"""One training step, lmlab vs nanoGPT, on the same model and batch, interleaved in one process.

    python benchmarks/train_step_ab.py --profile-arch nanogpt,bf16 --rounds 60  # op by op
    python benchmarks/train_step_ab.py --phase-arch nanogpt,bf16 --rounds 300  # by phase
    python benchmarks/train_step_ab.py [--shapes nanogpt,minigpt] [--precisions fp32,bf16]
        [--rounds 20] [--threads 1] [--config CONFIG] [--reference] [--rope-kernel]
        [--softmax-kernel] [--attention-kernel] [--rope-attention] [--norm-kernel]
        [--gelu-kernel]
        [--silu-kernel] [--bias-add-kernel] [--add-kernel] [--clip-kernel]
        [--adamw-kernel]
        [--allocator]
        [--only lmlab,nanogpt,...]

For each shape and precision it builds, in this one process:

- **nanogpt**: nanoGPT's model and optimizer, imported from the faithful reimplementation in
  ``benchmarks/time_to_loss.py`` (``NanoGPT``, ``nanogpt_optimizer``): bias-free Pre-LN blocks,
  fused c_attn, learned positions, tied head; AdamW as nanoGPT builds it on a CPU (torch's default
  implementation, not fused). Its step is train.py's: ``get_batch``, forward (inside
  ``torch.autocast(cpu, bfloat16)`` for bf16, nanoGPT's ``ctx``; nothing for fp32, as its README
  runs a CPU), backward, ``clip_grad_norm_(1.0)``, ``step``, ``zero_grad(set_to_none=True)``.
- **lmlab**: lmlab's default model (the library's dataclass defaults, or ``--config``: RoPE,
  biases, GELU MLP, tied head) at that shape, its optimizer and one optimizer step of its own
  :meth:`lmlab.training.loop.Trainer.train_step` (batch sampling, autocast at
  ``train.precision``, clipping, the optimizer, the schedule), built by
  ``time_to_loss.lmlab_session`` as ``lmlab train`` builds a run.
- **lmlab-ref** (``--reference``): lmlab's default again with its training fast paths off (the
  q/k/v fusion, the bf16 batched-matmul attention, the bf16 RoPE function; module flags), so
  ``lmlab fast paths on/off`` is what they gain, measured in the same loop.
- **torchrope** (``--rope-kernel``): lmlab's default with only the C++ RoPE kernel
  (:mod:`lmlab.nn.rope_kernel`) off, RoPE as torch ops: ``lmlab rope kernel on/off``.
- **torchsoftmax** (``--softmax-kernel``): lmlab's default with only the C++ causal softmax
  kernel (:func:`lmlab.nn.train_kernel.causal_softmax_`) off, the bf16 attention's mask and
  softmax as torch's masked_fill + softmax: ``lmlab softmax kernel on/off``.
- **bmmattn** (``--attention-kernel``): lmlab's default with only the fused bf16 causal
  attention (``torch.ops.lmlab.causal_attention_bf16``, AVX512-BF16 CPUs) off, the three
  batched matmuls with the softmax kernel instead: ``lmlab fused attention kernel on/off``.
- **splitrope** (``--rope-attention``): lmlab's default with only RoPE inside the fused
  attention off (``torch.ops.lmlab.rope_causal_attention_bf16``,
  ``lmlab.nn.attention.TRAIN_ROPE_ATTENTION``): the RoPE split kernel, then the fused
  attention: ``lmlab rope in attention on/off``.
- **torchnorm** (``--norm-kernel``): lmlab's default with only the C++ norm-to-bf16 kernel
  (:func:`lmlab.nn.train_kernel.norm_bf16`) off, the pre-norm blocks' norms as torch's float32
  norm then autocast's cast: ``lmlab norm kernel on/off``.
- **torchgelu** (``--gelu-kernel``): lmlab's default with only the MLP's one-pass bias + GELU
  operator (``lmlab.nn.train_kernel.gelu_up``) off, the up projection's ``addmm`` and torch's
  gelu instead: ``lmlab gelu kernel on/off``.
- **biasedproj** (``--bias-add-kernel``): lmlab's default with only the residual add's bias off
  (``lmlab.nn.train_kernel.TRAIN_RESIDUAL_BIAS``): the FFN's down projection keeps its bias in
  its ``addmm``, then the plain residual add: ``lmlab residual bias add on/off``.
- **torchsilu** (``--silu-kernel``): lmlab's default with only the gated FFNs' one-pass
  silu(gate) * up (``lmlab.nn.train_kernel.silu_mul``) off: torch's silu and multiply, ``lmlab
  silu * up kernel on/off`` (the default MLP has no gate: use ``--config`` with a swiglu model).
- **torchadd** (``--add-kernel``) and **torchclip** (``--clip-kernel``): lmlab's default with only
  the one-pass residual add (``lmlab.nn.train_kernel.residual_add``) or only the one-call
  gradient clipping (``lmlab.nn.train_kernel.clip_grads_``) off: ``lmlab residual add kernel
  on/off``, ``lmlab clip kernel on/off``.
- **torchadamw** (``--adamw-kernel``): lmlab's default with only the one-call AdamW step
  (:class:`lmlab.training.optim.AdamW`, ``ADAMW_KERNEL``) off: torch's fused AdamW, tensor by
  tensor (the same bits), ``lmlab adamw kernel on/off``.
- **untuned** (``--allocator``): lmlab's default with glibc's own malloc policy instead of
  lmlab's thresholds (:mod:`lmlab.training.allocator`; :func:`untuned_allocator`): ``lmlab malloc
  tuning on/off``. nanoGPT's step always runs under glibc's own policy, as in its own process.
- **plain**: lmlab with nanoGPT's architecture (learned positions, no biases in linears or
  norms), the same Trainer step: ``lmlab default / plain`` is what lmlab's default architecture
  costs.

Shapes: ``nanogpt`` = nanoGPT's README CPU shape (4 layers, d 128, 4 heads, ctx 64, batch 12);
``minigpt`` = the Mini-GPT shape (6 layers, d 256, 4 heads, ctx 256, batch 16). Vocabulary: the
65 characters of tinyshakespeare on both sides.

Timing: after warm-up steps, ``--rounds`` rounds each take one step of every contender, in a
new random order every round (seeded; a rotation A B C, B C A, ... made each contender always
follow the same one, which biased the one after nanoGPT by 2-3%); the figure is the ratio of
medians (and of bests) of the per-step seconds. Printed per shape (all of a shape's
contenders, both precisions, in one interleaved loop)::

    step lmlab/nanogpt (minigpt shape, bf16) = N.NNx   (best-of-N: N.NNx; paired N.NNx, 90% CI ...)
    step lmlab bf16/nanogpt fp32 (minigpt shape, default precision) = N.NNx   (...)
    step lmlab default/plain (minigpt shape, bf16) = N.NNx   (...)

the first per precision (nanoGPT under the same autocast as lmlab), the second lmlab's default
precision here (``train.precision: auto`` = bf16 autocast on a CPU with bf16 units) against
nanoGPT as its README runs on a CPU (float32); ratios of medians, best-of-N beside them, and
the paired figure (:func:`paired_ratio`): the median of the per-round ratios with a 90%
bootstrap interval, which tells a 1-2% effect from a noisy machine's drift.

each contender's minor page faults per step (``resource.getrusage``: pages the kernel zeroed on
first write, memory malloc gave back and took again; see :mod:`lmlab.training.allocator`), and
each contender's tokens/s and model FLOP/s as a fraction of the matmul peak measured in
this process at that precision (:func:`lmlab.training.hardware.measure_matmul_peak`, best of the
measurements taken before and after the steps). The FLOPs are lmlab's count
(``flops_per_token``: 3 x (2 N + 4 L T d) per token, N the matmul parameters with the head) for
every contender: the three do the same matmuls. Threads: ``--threads`` (1 by default: the shared
machines this project runs on; 2 on a quiet 2-core machine for the full-machine figure).
"""

from __future__ import annotations

import argparse
import functools
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_loss import NanoConfig, NanoGPT, lmlab_session, nanogpt_optimizer  # noqa: E402

from lmlab.training import allocator  # noqa: E402
from lmlab.training.hardware import measure_matmul_peak  # noqa: E402

SHAPES = {  # n_layers, d_model, n_heads, ctx, batch
    "nanogpt": (4, 128, 4, 64, 12),
    "minigpt": (6, 256, 4, 256, 16),
}
PLAIN = [  # nanoGPT's architecture in lmlab's fields
    "model.position.kind=learned",
    "model.attention.bias=false",
    "model.ffn.bias=false",
    "model.norm.bias=false",
]


@contextmanager
def untuned_allocator() -> Iterator[None]:
    """Within: glibc's own malloc policy at its most generous (``allocator.GLIBC_DEFAULT_MAX``:
    the 32 MiB mmap / 64 MiB trim thresholds its dynamic threshold reaches at most), as in a
    process that never tuned it (nanoGPT's, or lmlab's with ``LMLAB_NO_MALLOC_TUNING=1``); after:
    lmlab's thresholds again when :func:`allocator.keep_freed_memory` put them in force. Switched
    per step, the untuned step starts from a heap the tuned one grew and trims it at once, and
    the tuned step after it grows it again: this understates what the tuning gains."""
    if not allocator.keep_freed_memory():
        yield
        return
    allocator.set_malloc_thresholds(*allocator.GLIBC_DEFAULT_MAX)
    try:
        yield
    finally:
        allocator.set_malloc_thresholds(allocator.MMAP_THRESHOLD, allocator.TRIM_THRESHOLD)


# The shape "config": the --config file's own model and batch (only the precision and the
# benchmark's settings overridden); nanoGPT has no contender there (another architecture).
AS_CONFIGURED = "config"


def shape_overrides(shape: str, precision: str) -> list[str]:
    if shape == AS_CONFIGURED:
        return [f"train.precision={precision}", "train.compile=false", "train.max_steps=100000"]
    n_layers, d, heads, ctx, batch = SHAPES[shape]
    return [
        f"model.n_layers={n_layers}",
        f"model.d_model={d}",
        f"model.attention.n_heads={heads}",
        f"model.max_seq_len={ctx}",
        "train.seq_len=null",
        f"train.batch_size={batch}",
        "train.grad_accum_steps=1",
        f"train.precision={precision}",
        "train.compile=false",
        "train.max_steps=100000",
        "model.dropout=0.0",
        "model.attention.dropout=0.0",
    ]


def nanogpt_step(shape: str, precision: str, ids: torch.Tensor) -> Callable[[], None]:
    """One of nanoGPT's train.py iterations at ``shape`` (get_batch, forward, backward, clip,
    AdamW step, zero_grad); bf16: the forward under torch.autocast(cpu, bfloat16)."""
    n_layers, d, heads, ctx, batch = SHAPES[shape]
    torch.manual_seed(1337)
    model = NanoGPT(NanoConfig(65, ctx, n_layers, heads, d, False))
    opt = nanogpt_optimizer(model, 1e-3, 0.1)
    amp = precision == "bf16"

    def step() -> None:
        with untuned_allocator():  # nanoGPT's process keeps glibc's own malloc policy
            ix = torch.randint(len(ids) - ctx, (batch,))
            x = torch.stack([ids[i : i + ctx] for i in ix])
            y = torch.stack([ids[i + 1 : i + 1 + ctx] for i in ix])
            with torch.autocast("cpu", dtype=torch.bfloat16) if amp else nullcontext():
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes",
        default="nanogpt,minigpt",
        help="nanogpt, minigpt, or config: --config's own model and batch (no nanoGPT contender)",
    )
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", default=None, help="lmlab config (default: the defaults)")
    ap.add_argument("--no-plain", action="store_true", help="skip lmlab's plain architecture")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also lmlab with its training fast paths off (lmlab-ref): what they gain",
    )
    ap.add_argument(
        "--rope-kernel",
        action="store_true",
        help="also lmlab with only its C++ RoPE kernel off (torchrope): what it gains",
    )
    ap.add_argument(
        "--softmax-kernel",
        action="store_true",
        help="also lmlab with only its C++ causal softmax kernel off (torchsoftmax)",
    )
    ap.add_argument(
        "--attention-kernel",
        action="store_true",
        help="also lmlab with only its fused bf16 causal attention off, the batched matmuls "
        "instead (bmmattn)",
    )
    ap.add_argument(
        "--rope-attention",
        action="store_true",
        help="also lmlab with only RoPE inside the fused attention off: the split kernel, "
        "then the attention (splitrope)",
    )
    ap.add_argument(
        "--norm-kernel",
        action="store_true",
        help="also lmlab with only its C++ norm-to-bf16 kernel off (torchnorm)",
    )
    ap.add_argument(
        "--gelu-kernel",
        action="store_true",
        help="also lmlab with only its one-pass bias + GELU of the MLP's up projection off "
        "(torchgelu)",
    )
    ap.add_argument(
        "--silu-kernel",
        action="store_true",
        help="also lmlab with only its one-pass silu(gate) * up of gated FFNs off (torchsilu)",
    )
    ap.add_argument(
        "--bias-add-kernel",
        action="store_true",
        help="also lmlab with only its FFN down projection's bias added by the residual add "
        "off: the biased addmm, then the add (biasedproj)",
    )
    ap.add_argument(
        "--add-kernel",
        action="store_true",
        help="also lmlab with only its one-pass residual add off (torchadd)",
    )
    ap.add_argument(
        "--clip-kernel",
        action="store_true",
        help="also lmlab with only its one-call gradient clipping off (torchclip)",
    )
    ap.add_argument(
        "--adamw-kernel",
        action="store_true",
        help="also lmlab with only its one-call AdamW step off: torch's fused AdamW (torchadamw)",
    )
    ap.add_argument(
        "--only",
        metavar="NAMES",
        help="time only these contenders, e.g. lmlab (alone: no other step trims its heap)",
    )
    ap.add_argument(
        "--allocator",
        action="store_true",
        help="also lmlab with glibc's own malloc policy, not lmlab's thresholds (untuned)",
    )
    ap.add_argument(
        "--attention", action="store_true", help="only the bf16 attention paths (see attention_ab)"
    )
    ap.add_argument(
        "--profile",
        metavar="SHAPE,PRECISION",
        help="only profile 3 lmlab steps (torch.profiler, ops by self CPU time), e.g. minigpt,bf16",
    )
    ap.add_argument(
        "--profile-arch",
        metavar="SHAPE,PRECISION[,A,B]",
        help="only profile lmlab's architecture A against B (default: default,plain; names of "
        "ARCH_VARIANTS), op by op, ms per step (see profile_arch), e.g. minigpt,bf16",
    )
    ap.add_argument(
        "--phase-arch",
        metavar="SHAPE,PRECISION[,A,B]",
        help="only time lmlab's architecture A against B (default: default,plain) phase by "
        "phase: forward, backward, clipping, optimizer step, zero_grad (see phase_arch)",
    )
    ap.add_argument(
        "--matmuls",
        action="store_true",
        help="only the Mini-GPT step's bf16 matmul shapes alone, as a fraction of the peak",
    )
    ap.add_argument(
        "--arch",
        metavar="SHAPE",
        help="only lmlab's architecture variants at SHAPE (see arch_ab), e.g. minigpt",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.arch:
        arch_ab(args, args.arch)
        return
    if args.profile:
        profile_steps(args, *args.profile.split(","))
        return
    if args.matmuls:
        matmul_shapes(args.rounds)
        return
    if args.profile_arch:
        profile_arch(args, *args.profile_arch.split(","))
        return
    if args.phase_arch:
        phase_arch(args, *args.phase_arch.split(","))
        return
    if args.attention:
        attention_ab(args.rounds)
        return
    from time_to_loss import _text

    text = _text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.from_numpy(np.array([stoi[c] for c in text[: int(0.9 * len(text))]], np.int64))
    precisions = args.precisions.split(",")
    cpu = torch.device("cpu")
    peaks = {p: measure_matmul_peak(cpu, p, seconds=1.0) for p in precisions}
    print(f"threads {args.threads}; matmul peak " + ", ".join(
        f"{p} {peaks[p] / 1e9:.0f} GFLOP/s" for p in precisions), flush=True)  # fmt: skip
    results = [run_shape(args, shape, precisions, ids) for shape in args.shapes.split(",")]
    for p in precisions:  # the peak again, after: the best of the two is the denominator
        peaks[p] = max(peaks[p], measure_matmul_peak(cpu, p, seconds=1.0))
    print()
    for shape, times, tokens, flops in results:
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        for (name, p), v in med.items():
            tok_s = tokens / v
            mfu = flops * tok_s / peaks[p]
            print(
                f"  {name:<11}{p:<5}{shape + ' shape':<14} {1e3 * v:8.1f} ms/step "
                f"(best {1e3 * best[name, p]:.1f})  {tok_s:9,.0f} tokens/s  "
                f"MFU {100 * mfu:5.1f}% of the {p} peak"
            )

        pairs = [
            (f"lmlab/nanogpt ({shape} shape, {p})", "lmlab", p, "nanogpt", p) for p in precisions
        ]
        pairs.append(
            (
                f"lmlab bf16/nanogpt fp32 ({shape} shape, default precision)",
                "lmlab",
                "bf16",
                "nanogpt",
                "fp32",
            )
        )
        pairs += [
            (f"lmlab default/plain ({shape} shape, {p})", "lmlab", p, "plain", p)
            for p in precisions
        ]
        pairs += [
            (f"lmlab {label} on/off ({shape} shape, {p})", "lmlab", p, name, p)
            for name, _, _, label in OFF_CONTENDERS
            for p in precisions
        ]
        for what, a, pa, b, pb in pairs:
            if (a, pa) in med and (b, pb) in med:
                r = med[b, pb] / med[a, pa]
                rb = best[b, pb] / best[a, pa]
                paired = paired_ratio(times[a, pa], times[b, pb])
                print(f"step {what} = {r:.2f}x   (best-of-N: {rb:.2f}x; {paired})")
    print(f"matmul peak (best of before/after), FLOP/s: {peaks}")


# The contenders that are lmlab's default with one fast path off: (name, the command-line flag
# that adds it, trainer_step's keyword that switches the path off, the ratio's label).
OFF_CONTENDERS = (
    ("lmlab-ref", "reference", "fast_paths", "fast paths"),
    ("torchrope", "rope_kernel", "rope_kernel", "rope kernel"),
    ("torchsoftmax", "softmax_kernel", "softmax_kernel", "softmax kernel"),
    ("bmmattn", "attention_kernel", "attention_kernel", "fused attention kernel"),
    ("splitrope", "rope_attention", "rope_attention", "rope in attention"),
    ("torchnorm", "norm_kernel", "norm_kernel", "norm kernel"),
    ("torchgelu", "gelu_kernel", "gelu_kernel", "gelu kernel"),
    ("biasedproj", "bias_add_kernel", "bias_add_kernel", "residual bias add"),
    ("torchsilu", "silu_kernel", "silu_kernel", "silu * up kernel"),
    ("torchadd", "add_kernel", "add_kernel", "residual add kernel"),
    ("torchclip", "clip_kernel", "clip_kernel", "clip kernel"),
    ("torchadamw", "adamw_kernel", "adamw_kernel", "adamw kernel"),
    ("untuned", "allocator", "malloc_tuning", "malloc tuning"),
)


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000) -> str:
    """The median of the per-round ratios b[i] / a[i] (the same round: both steps ran within one
    random order, so a slow minute of the machine falls on both) and a 90% bootstrap interval
    of that median (seeded), as ``paired N.NNx, 90% CI N.NN-N.NNx``: a ratio whose interval
    holds 1.00 is not shown to differ from 1. On a noisy machine this separates a 1-2% effect
    from the noise better than the ratio of the two medians."""
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    lo, hi = meds[int(0.05 * resamples)], meds[int(0.95 * resamples) - 1]
    return f"paired {statistics.median(ratios):.2f}x, 90% CI {lo:.2f}-{hi:.2f}x"


def round_order(names: list, rng: random.Random) -> list:
    """One round's order of the contenders: a fresh random permutation (seeded, so a rerun
    repeats it). Not a rotation: with A B C, B C A, ... each contender always follows the same
    one, and a null A/B (identical lmlab contenders) then read 0.97-0.98x at the nanoGPT shape
    for the one run right after nanoGPT's step; a random order spreads that over all."""
    order = list(names)
    rng.shuffle(order)
    return order


def interleaved_medians(
    fns: dict[str, Callable[[], None]], rounds: int, before: Callable[[], None] | None = None
) -> dict[str, float]:
    """Median seconds of each function over ``rounds`` rounds, every round all of them in a
    fresh seeded random order (:func:`round_order`); ``before`` runs untimed before each call
    (e.g. clearing gradients). For the one-operation benchmarks (silu_mul_ab.py, adamw_ab.py);
    the step benchmark above keeps its own loop (it also counts page faults)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    rng = random.Random(0)
    for _ in range(rounds):
        for name in round_order(list(fns), rng):
            if before is not None:
                before()
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def run_shape(args: argparse.Namespace, shape: str, precisions: list[str], ids: torch.Tensor):
    """Build every contender at ``shape`` in every precision, time them interleaved; returns
    (shape, {(name, precision): [seconds per step]}, tokens per step, FLOPs per token)."""
    from lmlab.training.flops import flops_per_token

    with ExitStack() as stack:
        steps: dict[tuple[str, str], Callable[[], None]] = {}
        flops = tokens = 0
        for p in precisions:
            over = shape_overrides(shape, p)
            if shape != AS_CONFIGURED:
                steps["nanogpt", p] = nanogpt_step(shape, p, ids)
            lm = stack.enter_context(lmlab_session(args.config, over))
            steps["lmlab", p] = trainer_step(lm.trainer)
            if not args.no_plain:
                plain = stack.enter_context(lmlab_session(args.config, over + PLAIN))
                steps["plain", p] = trainer_step(plain.trainer)
            for name, attr, keyword, _ in OFF_CONTENDERS:
                if getattr(args, attr):
                    off = stack.enter_context(lmlab_session(args.config, over))
                    steps[name, p] = trainer_step(off.trainer, **{keyword: False})
            tokens = lm.cfg.train.batch_size * lm.seq_len
            flops = flops_per_token(lm.model, lm.cfg.model, lm.seq_len, True)
        if args.only:  # only these contenders (e.g. lmlab alone: its MFU with no neighbour)
            steps = {k: v for k, v in steps.items() if k[0] in args.only.split(",")}
        for fn in steps.values():
            for _ in range(args.warmup):
                fn()
        names = list(steps)
        times: dict[tuple[str, str], list[float]] = {k: [] for k in names}
        rng = random.Random(0)
        faults: dict[tuple[str, str], int] = dict.fromkeys(names, 0)  # minor page faults
        for _ in range(args.rounds):  # a new random order each round (see round_order)
            for k in round_order(names, rng):
                f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t)
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(
            f"{shape} shape: " + ", ".join(f"{a} {p} {v:.1f} ms" for (a, p), v in med.items()),
            flush=True,
        )
        print(  # pages the kernel zeroed on first touch: memory malloc gave back and took anew
            f"{shape} shape, minor page faults per step: "
            + ", ".join(f"{a} {p} {n / args.rounds:,.0f}" for (a, p), n in faults.items()),
            flush=True,
        )
    return shape, times, tokens, flops


ARCH_VARIANTS = {
    "default": [],
    "rope-nobias": PLAIN[1:],
    "learned-bias": PLAIN[:1],
    "plain": PLAIN,
    "no-attn-bias": PLAIN[1:2],
    "no-ffn-bias": PLAIN[2:3],
    "no-norm-bias": PLAIN[3:4],
}


def arch_ab(args: argparse.Namespace, shape: str) -> None:
    """lmlab's default architecture vs the same without biases, with learned positions instead
    of RoPE, and with both (plain), and without one family of biases each (attention's q/k/v/o,
    the FFN's, the norms'): Trainer steps at ``shape`` in the first of ``--precisions``,
    interleaved (a random order each round), medians; ratio = variant step time / default's."""
    precision = args.precisions.split(",")[0]
    over = shape_overrides(shape, precision)
    with ExitStack() as stack:
        steps = {
            k: trainer_step(stack.enter_context(lmlab_session(args.config, over + v)).trainer)
            for k, v in ARCH_VARIANTS.items()
        }
        for fn in steps.values():
            for _ in range(args.warmup):
                fn()
        names = list(steps)
        times: dict[str, list[float]] = {k: [] for k in names}
        rng = random.Random(0)
        for _ in range(args.rounds):
            for k in round_order(names, rng):
                start = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in names[1:]:
        print(
            f"step lmlab default/{k} ({shape} shape, {precision}) = "
            f"{med[k] / med['default']:.2f}x   "
            f"({1e3 * med['default']:.1f} vs {1e3 * med[k]:.1f} ms; "
            f"{paired_ratio(times['default'], times[k])})"
        )


def profile_steps(args: argparse.Namespace, shape: str, precision: str) -> None:
    """torch.profiler over 3 of lmlab's Trainer steps (after 3 warm-up steps): every op's count
    and share of the self CPU time (``--reference``: with the fast paths off)."""
    from torch.profiler import ProfilerActivity, profile

    with lmlab_session(args.config, shape_overrides(shape, precision)) as lm:
        step = trainer_step(lm.trainer, fast_paths=not args.reference)
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def profile_arch(
    args: argparse.Namespace, shape: str, precision: str, a: str = "default", b: str = "plain"
) -> None:
    """torch.profiler around each of ``--rounds`` Trainer steps of lmlab's architecture
    variants ``a`` and ``b`` (:data:`ARCH_VARIANTS`) at ``shape``, interleaved (both built in
    this process, 3 warm-up steps each, then a random order every round, as the timed A/Bs): the
    total self CPU time per step of each and, for the 28 ops whose self CPU time differs most,
    each one's ms per step (calls per step) in a and in b and the difference: where a's extra
    time goes. A slow minute of the machine falls on both; the profiler's own cost is in both."""
    from torch.profiler import ProfilerActivity, profile

    names = [a, b]
    per_step: dict[str, dict[str, tuple[float, float]]] = {n: {} for n in names}
    with ExitStack() as stack:
        steps = {}
        for name in names:
            over = shape_overrides(shape, precision) + ARCH_VARIANTS[name]
            steps[name] = trainer_step(
                stack.enter_context(lmlab_session(args.config, over)).trainer
            )
            for _ in range(3):
                steps[name]()
        rng = random.Random(0)
        for _ in range(args.rounds):
            for name in round_order(names, rng):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    steps[name]()
                acc = per_step[name]
                for e in prof.key_averages():
                    t0, c0 = acc.get(e.key, (0.0, 0.0))
                    acc[e.key] = (
                        t0 + e.self_cpu_time_total / args.rounds / 1e3,
                        c0 + e.count / args.rounds,
                    )
    total = {n: sum(v[0] for v in per_step[n].values()) for n in (a, b)}
    print(
        f"{shape} shape, {precision}, {args.threads} thread(s): self CPU ms/step "
        f"{a} {total[a]:.1f}, {b} {total[b]:.1f}"
    )
    zero = (0.0, 0.0)
    keys = sorted(
        set(per_step[a]) | set(per_step[b]),
        key=lambda k: -abs(per_step[a].get(k, zero)[0] - per_step[b].get(k, zero)[0]),
    )
    print(f"{'op':<48} {a + ' ms (calls)':>18} {b + ' ms (calls)':>18}   {a} - {b}")
    for k in keys[:28]:
        (ta, ca), (tb, cb) = per_step[a].get(k, zero), per_step[b].get(k, zero)
        op = k.replace("torch::autograd::CppNode<(anonymous namespace)::", "backward of ")
        print(f"{op[:48]:<48} {ta:9.2f} ({ca:5.0f}) {tb:10.2f} ({cb:5.0f})   {ta - tb:+8.2f}")


def phase_arch(
    args: argparse.Namespace, shape: str, precision: str, a: str = "default", b: str = "plain"
) -> None:
    """``--rounds`` Trainer steps of lmlab's architecture variants ``a`` and ``b``
    (:data:`ARCH_VARIANTS`) at ``shape``, interleaved (3 warm-up steps each, then a random
    order every round), each step's wall time split by phase: the backward
    (``Tensor.backward``), clipping (``lmlab.training.loop.clip_gradients``), the optimizer's
    ``step`` and ``zero_grad`` (each wrapped by a timer for the run), and the rest (batch,
    forward, loss, schedule). Prints each phase's median ms per step for a and b and the
    difference: where a's extra time goes, without a profiler's own cost inside the ops."""
    import lmlab.training.loop as loop

    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*fargs: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*fargs, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        return run

    names = [a, b]
    phases = ["backward", "clip", "optimizer step", "zero_grad"]
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    saved = (loop.clip_gradients, torch.Tensor.backward)
    with ExitStack() as stack:
        steps = {}
        for name in names:
            over = shape_overrides(shape, precision) + ARCH_VARIANTS[name]
            trainer = stack.enter_context(lmlab_session(args.config, over)).trainer
            steps[name] = trainer_step(trainer)
            opt = trainer.optimizer
            opt.step = timed("optimizer step", opt.step)  # type: ignore[method-assign]
            opt.zero_grad = timed("zero_grad", opt.zero_grad)  # type: ignore[method-assign]
        try:
            loop.clip_gradients = timed("clip", loop.clip_gradients)  # type: ignore[assignment]
            torch.Tensor.backward = timed("backward", torch.Tensor.backward)  # type: ignore[method-assign]
            for name in names:
                for _ in range(3):
                    steps[name]()
            rng = random.Random(0)
            for _ in range(args.rounds):
                for name in round_order(names, rng):
                    spent.clear()
                    start = time.perf_counter()
                    steps[name]()
                    total = time.perf_counter() - start
                    rest = total - sum(spent.get(p, 0.0) for p in phases)
                    for p, t in [
                        *((p, spent.get(p, 0.0)) for p in phases),
                        ("forward and rest", rest),
                        ("total", total),
                    ]:
                        times[name].setdefault(p, []).append(1e3 * t)
        finally:
            loop.clip_gradients, torch.Tensor.backward = saved  # type: ignore[method-assign]
    print(f"{shape} shape, {precision}, {args.threads} thread(s), {args.rounds} rounds: median ms")
    print(f"{'phase':<18} {a:>10} {b:>10}   {a} - {b}")
    for p in times[a]:
        ma, mb = statistics.median(times[a][p]), statistics.median(times[b][p])
        print(f"{p:<18} {ma:10.3f} {mb:10.3f}   {ma - mb:+8.3f}")


MATMUL_SHAPES = {  # (batch, M, K, N) of the Mini-GPT bf16 step's matmuls (16 x 256 tokens)
    "q/k/v projection (4096, 256) x (256, 768)": (1, 4096, 256, 768),
    "MLP up (4096, 256) x (256, 1024)": (1, 4096, 256, 1024),
    "MLP down (4096, 1024) x (1024, 256)": (1, 4096, 1024, 256),
    "out projection (4096, 256) x (256, 256)": (1, 4096, 256, 256),
    "MLP up weight gradient (1024, 4096) x (4096, 256)": (1, 1024, 4096, 256),
    "attention scores bmm (64, 256, 64) x (64, 64, 256)": (64, 256, 64, 256),
}


def matmul_shapes(rounds: int) -> None:
    """Each of :data:`MATMUL_SHAPES` in bf16 alone (the same operands each call, median of
    ``rounds``) as TFLOP/s and a fraction of the bf16 matmul peak measured here: how near the
    peak this step's matmuls can run at all."""
    from lmlab.training.hardware import measure_matmul_peak

    peak = measure_matmul_peak(torch.device("cpu"), "bf16", seconds=1.0)
    for name, (b, m, k, n) in MATMUL_SHAPES.items():
        x = torch.randn(b, m, k, dtype=torch.bfloat16)
        w = torch.randn(b, k, n, dtype=torch.bfloat16)
        a, c = (x[0], w[0]) if b == 1 else (x, w)
        op = torch.mm if b == 1 else torch.bmm
        op(a, c)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            op(a, c)
            times.append(time.perf_counter() - start)
        rate = 2 * b * m * k * n / statistics.median(times)
        print(f"{name}: {rate / 1e12:.2f} TFLOP/s = {100 * rate / peak:.0f}% of the bf16 peak")
    print(f"bf16 matmul peak {peak / 1e12:.2f} TFLOP/s")


ATTENTION_SHAPES = [(12, 4, 64, 32), (16, 4, 256, 64), (4, 4, 512, 64), (2, 4, 1024, 64)]


def attention_ab(rounds: int) -> None:
    """Causal attention forward + backward in bf16, (B, H, T, hd) as in ATTENTION_SHAPES (the
    nanoGPT and Mini-GPT shapes, then longer contexts): torch's fused CPU kernel
    (F.scaled_dot_product_attention, is_causal) vs lmlab's batched-matmul path
    (lmlab.nn.attention_core.causal_attention_bmm, what the sdpa backend runs for bf16 training
    up to BMM_CAUSAL_MAX_T tokens), q/k/v strided views of one projection output as in a model;
    interleaved, ratio of medians."""
    import torch.nn.functional as F

    from lmlab.nn.attention_core import BMM_CAUSAL_MAX_T, causal_attention_bmm

    for b, h, t, hd in ATTENTION_SHAPES:
        torch.manual_seed(0)
        qkv = torch.randn(b, t, 3 * h, hd, dtype=torch.bfloat16)
        q, k, v = (
            qkv[:, :, i * h : (i + 1) * h].transpose(1, 2).requires_grad_() for i in range(3)
        )
        g = torch.randn(b, h, t, hd, dtype=torch.bfloat16)
        fns = {
            "sdpa": functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True),
            "bmm": functools.partial(causal_attention_bmm, q, k, v, hd**-0.5),
        }
        times: dict[str, list[float]] = {n: [] for n in fns}
        for r in range(rounds + 1):
            for n, fn in list(fns.items()) if r % 2 else list(fns.items())[::-1]:
                start = time.perf_counter()
                fn().backward(g)
                if r:  # the first round warms up
                    times[n].append(time.perf_counter() - start)
        med = {n: statistics.median(v) for n, v in times.items()}
        used = "bmm" if t <= BMM_CAUSAL_MAX_T else "sdpa"
        print(
            f"attention fwd+bwd bmm/sdpa (B {b}, H {h}, T {t}, hd {hd}, bf16) = "
            f"{med['sdpa'] / med['bmm']:.2f}x   (sdpa {1e3 * med['sdpa']:.1f} ms, bmm "
            f"{1e3 * med['bmm']:.1f} ms; training takes {used})"
        )


# trainer_step's keywords that switch one training fast path off: (module, flag) set False
# for the step (module names under lmlab)
PATH_FLAGS = {
    "rope_kernel": ("nn.position", "TRAIN_ROPE_KERNEL"),
    "softmax_kernel": ("nn.attention_core", "TRAIN_SOFTMAX_KERNEL"),
    "attention_kernel": ("nn.attention_core", "TRAIN_FUSED_ATTENTION"),
    "rope_attention": ("nn.attention", "TRAIN_ROPE_ATTENTION"),
    "norm_kernel": ("nn.norm", "TRAIN_NORM_KERNEL"),
    "add_kernel": ("nn.train_kernel", "TRAIN_ADD_KERNEL"),
    "gelu_kernel": ("nn.train_kernel", "TRAIN_GELU_KERNEL"),
    "silu_kernel": ("nn.train_kernel", "TRAIN_SILU_KERNEL"),
    "bias_add_kernel": ("nn.train_kernel", "TRAIN_RESIDUAL_BIAS"),
    "clip_kernel": ("training.guard", "CLIP_KERNEL"),
    "adamw_kernel": ("training.optim", "ADAMW_KERNEL"),
}


def trainer_step(
    trainer, fast_paths: bool = True, malloc_tuning: bool = True, **paths: bool
) -> Callable[[], None]:
    """One ``Trainer.train_step`` per call, at the next step number; ``fast_paths`` False runs
    it with the training fast paths switched off (the q/k/v fusion, the bf16 batched-matmul
    attention, the bf16 RoPE function, the C++ RoPE, causal softmax, norm, residual add and
    clipping kernels, the one-call AdamW step, the bias + GELU and silu * up operators, the
    residual add's bias): the reference path they replace. ``paths`` (keywords of
    :data:`PATH_FLAGS`) False switch one off: ``rope_kernel`` the C++ RoPE kernel (RoPE as
    torch ops, as before it); ``softmax_kernel`` the causal softmax kernel (masked_fill +
    softmax); ``attention_kernel`` the fused bf16 attention (the batched matmuls instead);
    ``rope_attention`` RoPE inside it (the split kernel first);
    ``norm_kernel`` the norm-to-bf16 kernel (torch's norm, then a cast); ``add_kernel`` the
    one-pass residual add (torch's x + y); ``gelu_kernel`` the MLP's bias + GELU operator
    (addmm and torch's gelu); ``bias_add_kernel`` the residual add's bias (the down
    projection's addmm keeps it); ``silu_kernel`` the gated FFNs' silu(gate) * up operator
    (torch's silu and mul); ``clip_kernel`` the one-call gradient clipping (torch's
    clip_grad_norm_); ``adamw_kernel`` the one-call AdamW step (torch's fused AdamW, the same
    bits). ``malloc_tuning`` False only lmlab's malloc thresholds (the step runs under
    :func:`untuned_allocator`). The module flags are set for the step and restored after it."""
    import importlib

    import lmlab.nn.attention as attention
    import lmlab.nn.attention_core as core
    import lmlab.nn.position as position

    unknown = set(paths) - set(PATH_FLAGS)
    if unknown:
        raise TypeError(f"trainer_step: unknown fast paths {sorted(unknown)}")
    overrides: list[tuple[object, str, object]] = []  # (module, flag, value during the step)
    if not fast_paths:
        overrides += [(attention, "TRAIN_FUSED_QKV", False), (core, "BMM_CAUSAL_MAX_T", 0)]
        overrides += [(position, "TRAIN_ROTATE_HALF", False)]
    for keyword, (module, flag) in PATH_FLAGS.items():
        if not (fast_paths and paths.get(keyword, True)):
            overrides.append((importlib.import_module(f"lmlab.{module}"), flag, False))
    count = [0]

    def step() -> None:
        saved = [(m, name, getattr(m, name)) for m, name, _ in overrides]
        for m, name, value in overrides:
            setattr(m, name, value)
        try:
            with nullcontext() if malloc_tuning else untuned_allocator():
                trainer.train_step(count[0])
        finally:
            for m, name, value in saved:
                setattr(m, name, value)
        count[0] += 1

    return step


if __name__ == "__main__":
    main()
