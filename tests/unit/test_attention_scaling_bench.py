"""benchmarks/attention_scaling.py: its quick mode runs and its KV-cache column is the model's
declared size, checked against what the cache held, growing with the context or flat."""

from lmlab.registry import families
from tests.helpers.benchmarks import load_benchmark


def _bench():
    return load_benchmark("attention_scaling")


def test_quick_mode_on_two_lengths_writes_table_and_plot_with_checked_cache_bytes(tmp_path):
    bench = _bench()
    designs = ["full", "gqa", "sliding_window", "mla", "linear"]
    argv = ["--quick", "--lengths", "64", "128", "--new-tokens", "2", "--out", str(tmp_path)]
    points = bench.main([*argv, "--designs", *designs])
    by = {(p.design, p.length): p for p in points}
    assert set(by) == {(d, n) for d in designs for n in (64, 128)}
    for p in points:  # declared == what the cache held while decoding token L + 1
        assert p.declared_bytes == p.held_bytes, p
        assert p.prefill_s > 0 and p.decode_tok_s > 0
    row = 2 * 2 * 4 * 32 * 4  # full: k and v, 2 layers, 4 kv heads of 32, float32
    assert by["full", 64].declared_bytes == 65 * row
    assert by["full", 128].declared_bytes == 129 * row
    assert by["gqa", 128].declared_bytes == 129 * row // 2
    assert by["mla", 128].declared_bytes == 129 * 2 * (48 + 16) * 4  # latent + rope key
    # bounded caches: the 64-token window and linear attention's state stay flat
    assert by["sliding_window", 64].declared_bytes == by["sliding_window", 128].declared_bytes
    assert by["linear", 64].declared_bytes == by["linear", 128].declared_bytes
    md = (tmp_path / "attention_scaling.md").read_text()
    for d in designs:
        assert f"| `{d}` | 128 |" in md
    assert (tmp_path / "attention_scaling.png").stat().st_size > 10_000
    assert (tmp_path / "attention_scaling.json").exists()


def test_every_registered_attention_kind_is_a_design_and_unknown_ones_are_skipped():
    bench = _bench()
    table = bench.all_designs(64, 32)
    kinds = {a.get("kind", "softmax") for a in table.values()}
    assert set(families()["attention"]) <= kinds
    assert bench.unregistered({"kind": "no-such-kind"}) == (
        "attention 'no-such-kind' is not registered here"
    )
    assert bench.unregistered({"mask": "no-such-mask"}) is not None
    assert bench.unregistered(table["mla_absorb"]) is None


def test_a_design_slower_than_max_prefill_s_is_not_run_at_longer_lengths():
    bench = _bench()
    cpu = bench.torch.device("cpu")
    points, skipped, _ = bench.run([32, 64, 128], 2, 1, 0, 16, 8, cpu, ["full", "linear"], 0.0)
    assert [(p.design, p.length) for p in points] == [("full", 32), ("linear", 32)]
    assert set(skipped) == {"full", "linear"}
    assert skipped["full"].startswith("not run past 32 tokens: its prefill took")
