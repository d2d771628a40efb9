"""Peak-memory estimate: exact parameter counts without allocation, the formula by hand, and a
clear refusal when a run cannot fit."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from lmlab.errors import LmlabError
from lmlab.models import build_model
from lmlab.nn import ATTENTION, BLOCK, FFN, NORM, POSITION
from lmlab.training import memory
from lmlab.training.memory import (
    check_training_memory,
    count_parameters,
    estimate_training_memory,
    format_bytes,
)
from tests.helpers import tiny_config

CPU = torch.device("cpu")


def cfg_with(vocab_size: int = 65, **model):
    cfg = tiny_config(model=model) if model else tiny_config()
    cfg.model.vocab_size = vocab_size
    return cfg


VARIANTS = (
    [(f"position={k}", {"position": {"kind": k}}) for k in POSITION.names()]
    + [(f"ffn={k}", {"ffn": {"kind": k}}) for k in FFN.names()]
    + [(f"attention={k}", {"attention": {"n_heads": 4, "kind": k}}) for k in ATTENTION.names()]
    + [(f"block={k}", {"block": {"kind": k}}) for k in BLOCK.names()]
    + [(f"norm={k}", {"norm": {"kind": k}}) for k in NORM.names()]
    + [
        ("untied+biases", {"tie_embeddings": False, "attention": {"n_heads": 4, "bias": True}}),
        ("gqa+qk_norm", {"attention": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True}}),
        ("moe+shared", {"ffn": {"kind": "moe", "shared_expert": True, "n_experts": 4}}),
        ("parallel", {"block": {"kind": "pre", "parallel": True}}),
        ("wide-heads", {"attention": {"n_heads": 4, "head_dim": 16}}),
    ]
)


@pytest.mark.parametrize("model", [v for _, v in VARIANTS], ids=[k for k, _ in VARIANTS])
def test_the_meta_device_count_is_exact_for_every_variant(model):
    cfg = cfg_with(**model)
    real = sum(p.numel() for p in build_model(cfg.model).parameters())
    assert count_parameters(cfg) == real  # tied weights once


def test_the_estimate_by_hand_for_the_tiny_config():
    cfg = cfg_with()  # fp32; B 4, T 32, L 2, D 32, H = K = 4, hd 8, F 128, V 65; sdpa
    p = count_parameters(cfg)
    est = estimate_training_memory(cfg)
    assert (est.weights, est.gradients, est.optimizer, est.autocast) == (4 * p, 4 * p, 8 * p, 0)
    tokens = 4 * 32
    # norm inputs (fp32), then norm outputs, q k v, attention output twice, up + activation
    layer = 8 * 32 + 4 * (2 * 32 + (3 * 4 + 2 * 4) * 8 + 2 * 128)
    head = (4 + 4) * 32 + (4 + 8) * 65  # final norm in and out; logits, log-probs, gradient
    assert est.activations == tokens * (2 * layer + head) == 689_664
    assert est.total == 16 * p + 689_664
    cfg.model.attention.backend = "math"  # materialised scores and probabilities: 2 H T each
    assert estimate_training_memory(cfg).activations == 689_664 + tokens * 2 * 4 * (2 * 4 * 32)
    cfg.model.attention.backend = "sdpa"
    cfg.train.precision = "bf16"  # 2-byte activations (norm inputs stay fp32), weight copies
    bf16 = estimate_training_memory(cfg)
    assert bf16.autocast == 2 * p
    # bf16 on a CPU, T 32: causal attention as batched matmuls keeps its probabilities, H T
    layer = 8 * 32 + 2 * (2 * 32 + 20 * 8 + 2 * 128 + 4 * 32)
    assert bf16.activations == tokens * (2 * layer + 6 * 32 + 10 * 65)


def test_the_bf16_batched_matmul_attention_counts_its_probabilities():
    # causal_attention_bmm (bf16 on a CPU, sdpa, T <= 256) keeps the (B H, T, T) bf16
    # probabilities for backward; saved_score_elements says 0 for sdpa, whose fused kernel
    # keeps none. B 4, T 32, L 2, H 4: 4 * 4 * 32 * 32 elements per layer at 2 bytes.
    cfg = cfg_with()
    cfg.train.precision, cfg.train.device = "bf16", "cpu"
    with_bmm = estimate_training_memory(cfg).activations
    probs = 2 * (4 * 4 * 32 * 32) * 2
    cfg.train.compile = True  # torch.compile fuses attention itself: the fused kernel's count
    assert with_bmm - estimate_training_memory(cfg).activations == probs
    cfg.train.compile = False
    for field, value in (("dropout", 0.1), ("n_kv_heads", 2), ("backend", "math")):
        other = cfg_with(attention={"n_heads": 4, field: value})
        other.train.precision, other.train.device = "bf16", "cpu"
        # dropout, GQA in the kernel, math (its own 2 H T): not this path
        bmm = memory._bmm_causal_elements(build_model_meta(other), other.train, 32, 2)
        from lmlab.nn.attention_core import SDPA_GQA

        # GQA: the kernel shares kv heads on torch >= 2.5 (no bmm path); before, k and v are
        # repeated to H heads and the path applies
        shared = field == "n_kv_heads" and not SDPA_GQA
        assert bmm == (2 * 4 * 32 if shared else 0), field
    alibi = cfg_with(position={"kind": "alibi"})
    alibi.train.precision = "bf16"
    assert memory._bmm_causal_elements(build_model_meta(alibi), alibi.train, 32, 2) == 0
    assert memory._bmm_causal_elements(build_model_meta(cfg), cfg.train, 32, 2) == 2 * 4 * 32
    assert memory._bmm_causal_elements(build_model_meta(cfg), cfg.train, 257, 2) == 0
    assert memory._bmm_causal_elements(build_model_meta(cfg), cfg.train, 32, 4) == 0  # fp32
    # what autograd saves: at T 128 with d_model 32 the probabilities are most of a layer's
    # activations; without counting them the estimate was about half the saved bytes
    big = tiny_config(
        model={"d_model": 32, "n_layers": 2, "max_seq_len": 128, "attention": {"n_heads": 4}},
        train={"batch_size": 2, "precision": "bf16", "device": "cpu"},
    )
    big.model.vocab_size = 65
    est = estimate_training_memory(big).activations
    saved = saved_activation_bytes(big)
    assert 0.85 < est / saved < 1.15, est / saved
    assert (est - 2 * 2 * 4 * 128 * 128 * 2) / saved < 0.85  # the old count fell short
    # a length 16 does not divide, head dim 16: the fused kernel (where built) keeps P in row
    # pairs of T rounded up to 16, 18 x 32 words a head at T 17, more than H T per token
    odd = tiny_config(
        model={"d_model": 64, "n_layers": 2, "max_seq_len": 17, "attention": {"n_heads": 4}},
        train={"batch_size": 2, "precision": "bf16", "device": "cpu"},
    )
    odd.model.vocab_size = 65
    ratio = estimate_training_memory(odd).activations / saved_activation_bytes(odd)
    assert 0.85 < ratio < 1.15, ratio


_GQA = {"n_heads": 4, "n_kv_heads": 2}


@pytest.mark.parametrize(
    "model",
    [{"attention": {"n_heads": 4, "kind": k}} for k in sorted(ATTENTION)]
    + [{"kind": "encoder_decoder"}, {"position": {"kind": "alibi"}}]
    # GQA: head dim 8, torch's kernel shares the kv heads; 16, the fused kernel (where built)
    + [{"attention": _GQA}, {"d_model": 64, "attention": _GQA}]
    + [{"d_model": 64, "attention": {**_GQA, "kind": "differential"}}]
    + [{"d_model": 64, "attention": {"n_heads": 4, "kind": "mla", "absorb": True}}],
    ids=[*sorted(ATTENTION), "encoder_decoder", "alibi", "gqa-hd8", "gqa-hd16", "diff-gqa"]
    + ["mla-absorb"],
)
def test_the_bmm_count_is_what_a_bf16_training_forward_calls(model, monkeypatch):
    """Every attention kind: the elements _bmm_causal_elements counts are the H T of each call
    of the bf16 batched-matmul attention in a real training forward (none for the kinds that
    compute their attention otherwise: counting them would refuse runs that fit)."""
    import lmlab.nn.attention_core as core

    calls: list[int] = []
    real = core.causal_attention_train  # the fused kernel or the batched matmuls: both keep P

    def spy(q, k, v, scale):
        calls.append(q.shape[1] * q.shape[2])  # H T per query token
        return real(q, k, v, scale)

    monkeypatch.setattr(core, "causal_attention_train", spy)
    cfg = tiny_config(
        model={"max_seq_len": 32, **model},
        train={"batch_size": 2, "precision": "bf16", "device": "cpu"},
    )
    cfg.model.vocab_size = 50
    torch.manual_seed(0)
    net = build_model(cfg.model).train()
    ids = torch.randint(0, 50, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(ids, decoder_input_ids=ids) if cfg.model.kind == "encoder_decoder" else net(ids)
    counted = memory._bmm_causal_elements(build_model_meta(cfg), cfg.train, 32, 2)
    assert counted == sum(calls)


def build_model_meta(cfg):
    from lmlab.models.counting import meta_model

    return meta_model(cfg.model)


def saved_activation_bytes(cfg) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward pass (weights
    and their autocast copies excluded: they are the 4 P and 2 P terms)."""
    from lmlab.analysis.contract import saved_activation_bytes as saved

    model = build_model(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.max_seq_len))
    bf16 = cfg.train.precision == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return saved(model, cfg.model, x)


SAVED = [
    ("mlp-fp32", {}, {}),
    ("mlp-bf16", {}, {"precision": "bf16"}),
    ("swiglu", {"ffn": {"kind": "swiglu"}}, {}),
    ("swiglu-bf16", {"ffn": {"kind": "swiglu"}}, {"precision": "bf16"}),
    ("math-backend", {"attention": {"n_heads": 4, "backend": "math"}}, {}),
    ("moe", {"ffn": {"kind": "moe", "n_experts": 4}}, {}),
    ("mqa-bf16", {"attention": {"n_heads": 4, "n_kv_heads": 1}}, {"precision": "bf16"}),
    ("post-norm", {"block": {"kind": "post"}}, {}),
]


@pytest.mark.parametrize("model, train", [v[1:] for v in SAVED], ids=[v[0] for v in SAVED])
def test_the_activation_formula_matches_what_autograd_saves(model, train):
    cfg = tiny_config(
        model={"d_model": 64, "n_layers": 2, "max_seq_len": 32, **model},
        train={"batch_size": 3, **train},
    )
    cfg.model.vocab_size = 65
    ratio = estimate_training_memory(cfg).activations / saved_activation_bytes(cfg)
    assert 0.85 < ratio < 1.15, ratio  # the formula adds the logits' backward-time gradient


def test_gradient_accumulation_does_not_raise_the_peak_but_the_micro_batch_does():
    cfg = cfg_with()
    base = estimate_training_memory(cfg).activations
    cfg.train.grad_accum_steps = 8
    assert estimate_training_memory(cfg).activations == base
    cfg.train.batch_size *= 2
    assert estimate_training_memory(cfg).activations == 2 * base


def test_a_run_that_does_not_fit_is_refused_with_what_to_reduce(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: (1 << 20, "a test"))
    big_batch = cfg_with()
    big_batch.train.batch_size = 512
    with pytest.raises(LmlabError) as e:
        check_training_memory(big_batch, CPU)
    msg = str(e.value)
    est = estimate_training_memory(big_batch)
    assert msg.startswith(f"this run needs about {format_bytes(est.total)} of memory at its peak")
    assert "more than the 1.0 MiB available on cpu (a test)" in msg
    assert "activations for batch 512 x 32 tokens" in msg and "reduce train.batch_size" in msg
    big_model = cfg_with(d_model=512)
    big_model.train.batch_size = 1
    with pytest.raises(LmlabError, match=r"reduce the model \(model.d_model"):
        check_training_memory(big_model, CPU)
    monkeypatch.setattr(memory, "available_memory", lambda device: None)  # unknown: no check
    assert check_training_memory(big_batch, CPU).total > 1 << 20


def test_a_muon_model_that_does_not_fit_is_advised_with_muons_state(monkeypatch):
    """Under train.optimizer: muon the estimate holds 4 bytes of state per Muon parameter and
    8 per AdamW one, and the advice says so (not AdamW's 16 bytes for every parameter)."""
    from lmlab.models.build import build_model
    from lmlab.training.optim import muon_param_names

    monkeypatch.setattr(memory, "available_memory", lambda device: (1 << 20, "a test"))
    cfg = cfg_with(d_model=512)
    cfg.train.batch_size, cfg.train.optimizer = 1, "muon"
    model = build_model(cfg.model)
    params = dict(model.named_parameters())
    p = sum(x.numel() for x in model.parameters())
    p_muon = sum(params[n].numel() for n in muon_param_names(model))
    assert 0 < p_muon < p
    est = estimate_training_memory(cfg)
    assert (est.parameters, est.muon_parameters) == (p, p_muon)
    assert est.optimizer == 4 * p_muon + 8 * (p - p_muon)
    with pytest.raises(LmlabError) as e:
        check_training_memory(cfg, CPU)
    msg = str(e.value)
    assert "16 bytes" not in msg and "reduce the model" in msg
    assert (
        f"its {p:,} parameters need 8 bytes each for weights and gradients, plus 4 of Muon state "
        f"for the {p_muon:,} Muon holds and 8 of AdamW state for the other {p - p_muon:,}"
    ) in msg
    assert f"Muon + AdamW state {format_bytes(est.optimizer)}" in msg


def test_a_10_terabyte_config_is_refused_without_allocating_it():
    cfg = cfg_with(d_model=16384, n_layers=200, attention={"n_heads": 128})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    with pytest.raises(LmlabError) as e:
        check_training_memory(cfg, CPU)
    assert time.perf_counter() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1 << 20  # < 1 GiB
    p = count_parameters(cfg)
    assert p > 6 * 10**11
    assert f"its {p:,} parameters need 16 bytes each" in str(e.value)
    assert "TiB of memory at its peak" in str(e.value)


def test_available_memory_on_cpu_reads_meminfo(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)  # no cgroup limit here
    got = memory.available_memory(CPU)
    assert got is not None and got[1] == "MemAvailable in /proc/meminfo"
    assert 1 << 26 < got[0] < 1 << 50  # between 64 MiB and 1 PiB


def _cgroup(monkeypatch, tmp_path, files: dict[str, str], proc: str) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "proc-cgroup").write_text(proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "proc-cgroup")


def test_a_cgroup_v2_limit_bounds_the_available_memory(monkeypatch, tmp_path):
    files = {"box/memory.max": "1073741824\n", "box/memory.current": "268435456\n"}
    _cgroup(monkeypatch, tmp_path, files, "0::/box\n")
    free, source = memory.available_memory(CPU)
    assert free == (1 << 30) - (1 << 28) and "box/memory.max" in source


def test_a_cgroup_v1_limit_bounds_the_available_memory(monkeypatch, tmp_path):
    files = {
        "memory/memory.limit_in_bytes": "536870912\n",
        "memory/memory.usage_in_bytes": "0\n",
    }
    _cgroup(monkeypatch, tmp_path, files, "4:memory:/\n")
    assert memory.available_memory(CPU) == (
        1 << 29,
        f"the cgroup memory limit in {tmp_path / 'memory' / 'memory.limit_in_bytes'}",
    )


def test_an_unlimited_cgroup_leaves_meminfo(monkeypatch, tmp_path):
    files = {"memory.max": "max\n", "memory/memory.limit_in_bytes": "9223372036854771712\n"}
    _cgroup(monkeypatch, tmp_path, files, "0::/\n")
    assert memory.available_memory(CPU)[1] == "MemAvailable in /proc/meminfo"


def test_the_training_check_refuses_what_the_cgroup_limit_cannot_hold(monkeypatch, tmp_path):
    _cgroup(monkeypatch, tmp_path, {"memory.max": "1048576\n"}, "0::/\n")
    with pytest.raises(LmlabError, match="cgroup memory limit"):
        check_training_memory(cfg_with(), CPU)
