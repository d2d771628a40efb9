"""llama.cpp's ``llama-bench`` as the quantized benchmarks' decode peer: run it, read its JSON.

    llama-bench -m FILE.gguf -t THREADS -p 0 -n NEW_TOKENS -r REPS -o json

prints a JSON list with one object per test; with ``-p 0`` (no prompt test: the build from the
llama-cpp-python 0.3.36 sdist dies with SIGILL in its prompt test on this VM, decode does not)
that is the one ``n_gen`` test, whose ``samples_ts`` are the tokens/s of its ``-r`` repetitions
(after llama-bench's own warm-up run). :func:`tok_s` takes their median. Where the binary comes
from: ``--llama-bench PATH`` or the ``LLAMA_BENCH`` environment variable; docs/quantization.md
("llama.cpp as the peer") shows the CMake build from the sdist.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

ENV = "LLAMA_BENCH"


class LlamaBenchError(RuntimeError):
    """llama-bench could not be run or its output not read (the message is one line)."""


def default_path() -> str | None:
    """``$LLAMA_BENCH`` when set and not empty, else None (no comparison)."""
    return os.environ.get(ENV) or None


def command(binary: str, gguf: str, threads: int, new_tokens: int, reps: int) -> list[str]:
    """The argument list of one decode-only llama-bench run."""
    return [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new_tokens),
            "-r", str(reps), "-o", "json"]  # fmt: skip


def tok_s(text: str, new_tokens: int) -> float:
    """Decode tokens/s from llama-bench's ``-o json`` output ``text``: the median of the
    ``samples_ts`` of its test with ``n_prompt`` 0 and ``n_gen`` ``new_tokens`` (``avg_ts`` where
    a build lists no samples). Raises LlamaBenchError naming the field that is missing or wrong."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise LlamaBenchError(f"llama-bench output is not JSON ({e})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise LlamaBenchError("llama-bench output: expected a JSON list of test objects")
    gen = [t for t in tests if t.get("n_prompt") == 0 and t.get("n_gen") == new_tokens]
    if len(gen) != 1:
        raise LlamaBenchError(
            f"llama-bench output: expected one test with n_prompt 0 and n_gen {new_tokens}, "
            f"found {len(gen)}"
        )
    samples = gen[0].get("samples_ts", [gen[0].get("avg_ts")])
    if not (
        isinstance(samples, list)
        and samples
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in samples)
    ):
        raise LlamaBenchError("llama-bench output: samples_ts / avg_ts must be positive numbers")
    return float(statistics.median(samples))


def run(
    binary: str, gguf: str, threads: int, new_tokens: int, reps: int = 3, timeout: float = 300.0
) -> float:
    """Run llama-bench once (``reps`` repetitions) and return its decode tokens/s (:func:`tok_s`).
    Raises LlamaBenchError (one line: a missing binary, a non-zero exit with its last stderr
    line, a timeout, unreadable output)."""
    cmd = command(binary, gguf, threads, new_tokens, reps)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LlamaBenchError(f"{binary}: no such file") from None
    except PermissionError:
        raise LlamaBenchError(f"{binary}: not executable") from None
    except subprocess.TimeoutExpired:
        raise LlamaBenchError(f"{binary}: no result within {timeout:.0f} s") from None
    except OSError as e:
        raise LlamaBenchError(f"{binary}: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no stderr"])[-1]
        raise LlamaBenchError(f"{binary} exited with {done.returncode}: {last}")
    return tok_s(done.stdout, new_tokens)
