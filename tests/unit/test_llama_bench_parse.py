"""benchmarks/llama_bench.py: llama-bench's ``-o json`` output (a recorded sample of the build from
the llama-cpp-python 0.3.36 sdist, trimmed to the fields read) gives the median of its decode
samples; malformed output and a missing binary raise one-line LlamaBenchError."""

import json

import pytest

from tests.helpers.benchmarks import load_benchmark

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 0 -n 64 -r 3 -o json`, 2026-12-02
SAMPLE = """[
  {
    "build_commit": "0c1e570",
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 64,
    "avg_ns": 649067603,
    "avg_ts": 176.908220,
    "stddev_ts": 114.178423,
    "samples_ns": [ 1420078718, 264170813, 262953280 ],
    "samples_ts": [ 45.0679, 242.267, 243.389 ]
  }
]"""


@pytest.fixture(scope="module")
def lb():
    return load_benchmark("llama_bench")


def test_median_of_the_decode_samples(lb) -> None:
    assert lb.tok_s(SAMPLE, 64) == pytest.approx(242.267)  # not avg_ts (176.9): the slow first
    no_samples = json.loads(SAMPLE)
    del no_samples[0]["samples_ts"]
    assert lb.tok_s(json.dumps(no_samples), 64) == pytest.approx(176.90822)


def test_bad_output_is_one_clear_error(lb) -> None:
    prompt_test = json.loads(SAMPLE)[0] | {"n_prompt": 32, "n_gen": 0}
    cases = {
        "not JSON": "segmentation fault",
        "JSON list": '{"n_gen": 64}',
        "found 0": SAMPLE.replace('"n_gen": 64', '"n_gen": 32'),
        "found 2": json.dumps(json.loads(SAMPLE) * 2),
        "positive numbers": SAMPLE.replace("45.0679", '"fast"'),
    }
    for match, text in cases.items():
        with pytest.raises(lb.LlamaBenchError, match=match):
            lb.tok_s(text, 64)
    assert lb.tok_s(json.dumps([prompt_test, *json.loads(SAMPLE)]), 64) == pytest.approx(242.267)


def test_command_and_a_missing_binary(lb, tmp_path) -> None:
    cmd = lb.command("/x/llama-bench", "m.gguf", 2, 64, 3)
    assert cmd[cmd.index("-p") + 1] == "0" and cmd[cmd.index("-n") + 1] == "64"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[-2:] == ["-o", "json"]
    with pytest.raises(lb.LlamaBenchError, match="no such file"):
        lb.run(str(tmp_path / "llama-bench"), "m.gguf", 1, 8)
    failing = tmp_path / "fails"
    failing.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(lb.LlamaBenchError, match="exited with 1: error: failed to load model"):
        lb.run(str(failing), "m.gguf", 1, 8)
