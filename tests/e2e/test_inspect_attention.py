"""End-to-end: ``lmlab inspect`` and ``lmlab attention`` in-process through lmlab.cli.main."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lmlab.analysis import costs
from lmlab.config import load_config
from tests.helpers import run_cli, tiny_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CJK_TEXT = "满纸荒唐言，一把辛酸泪！都云作者痴，谁解其中味？\n" * 40


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


@pytest.fixture(scope="module")
def cjk_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained 1 step on Chinese text (a character vocabulary of CJK characters)."""
    from lmlab.training.trainer import train

    root = tmp_path_factory.mktemp("cjk")
    (root / "hlm.txt").write_text(CJK_TEXT, encoding="utf-8")
    cfg = tiny_config(train={"max_steps": 1}, data={"corpus": str(root / "hlm.txt")})
    train(cfg, out=root / "run", progress=False)
    return root / "run"


# ----------------------------------------------------------------------------- inspect


def test_inspect_json_has_the_issue_keys_and_they_agree_with_the_formulas(capsys):
    code, out, _ = run_cli(
        capsys, "inspect", str(CONFIGS / "llama.yaml"), "--json", "--set", "model.vocab_size=500"
    )
    info = json.loads(out)
    assert code == 0
    for key in (
        "params_total",
        "params_non_embedding",
        "flops_per_token_forward",
        "flops_per_token_train",
        "kv_cache_bytes_per_token",
        "components",
    ):
        assert key in info, key
    cfg = load_config(CONFIGS / "llama.yaml", ["model.vocab_size=500"]).model
    assert info["flops_per_token_train"] == 3 * info["flops_per_token_forward"]
    assert info["flops_per_token_forward"] == costs.flops_per_token(cfg, cfg.max_seq_len)
    assert info["kv_cache_bytes_per_token"] == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert sum(info["components"].values()) == info["params_total"]
    assert info["params_active"] == info["params_total"] and info["moe"] is None


def test_inspect_flags_set_the_flops_length_and_the_cache_size(capsys):
    args = ["inspect", str(CONFIGS / "tiny.yaml"), "--json"]
    _, out, _ = run_cli(capsys, *args, "--seq-len", "16", "--batch", "3", "--context", "20")
    a = json.loads(out)
    _, out, _ = run_cli(capsys, *args, "--seq-len", "32", "--dtype", "bf16")
    b = json.loads(out)
    cfg = load_config(CONFIGS / "tiny.yaml").model
    d_attn = cfg.attention.n_heads * cfg.head_dim
    assert (
        b["flops_per_token_forward"] - a["flops_per_token_forward"]
        == 4 * cfg.n_layers * 16 * d_attn
    )
    assert a["kv_cache_bytes"] == 3 * 20 * a["kv_cache_bytes_per_token"]
    assert b["kv_cache_bytes_per_token"] * 2 == a["kv_cache_bytes_per_token"]  # bf16 vs float32
    assert a["training_memory"]["batch"] == 3 and a["training_memory"]["seq_len"] == 16


def test_inspect_reports_moe_total_and_active_parameters(capsys):
    code, out, _ = run_cli(capsys, "inspect", str(CONFIGS / "mixtral.yaml"))
    assert code == 0
    assert "active parameters per token" in out and "KV cache" in out and "FLOPs" in out


def test_inspect_a_hugging_face_folder_counts_what_transformers_counts(tmp_path: Path, capsys):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(vocab_size=90, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    hf_model = transformers.GPT2LMHeadModel(hf_cfg)
    hf_model.save_pretrained(tmp_path)
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path), "--json")
    info = json.loads(out)
    assert code == 0 and info["params_total"] == hf_model.num_parameters()  # tied head once
    assert info["components"]["position"] == 32 * 32 and info["kv_cache_dtype_bytes"] == 4


# ----------------------------------------------------------------------------- attention


def test_attention_writes_one_grid_per_layer_and_numbers_per_head(tiny_run: Path, tmp_path, capsys):
    out_dir = tmp_path / "maps"
    code, out, _ = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO: O", "--out", str(out_dir), "--json"
    )
    report = json.loads(out)
    assert code == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["layer-00.png", "layer-01.png"]
    assert len(report["heads"]) == 2 * 4 and report["tokens"][:6] == list("ROMEO:")
    for h in report["heads"]:
        assert 0 <= h["entropy"] <= h["entropy_max"] + 1e-9
        assert 0 <= h["sink"] <= 1 and h["mean_distance"] >= 0
    wide, _ = png_size(out_dir / "layer-00.png")  # 4 panels side by side
    code, out, _ = run_cli(
        capsys, "attention", str(tiny_run), "--text", "ROMEO: O", "--out", str(tmp_path / "one"),
        "--layer", "1", "--head", "2", "--json",
    )  # fmt: skip
    one = json.loads(out)
    assert [(h["layer"], h["head"]) for h in one["heads"]] == [(1, 2)]
    assert [Path(f).name for f in one["files"]] == ["layer-01.png"]
    narrow, _ = png_size(tmp_path / "one" / "layer-01.png")
    assert narrow < wide / 2  # one panel instead of four


def test_attention_text_output_lists_every_head(tiny_run: Path, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "attention", str(tiny_run), "--text", "KING", "--no-plot")
    assert code == 0 and "entropy" in out and "wrote" not in out
    assert len([ln for ln in out.splitlines() if ln.split()[:1] in (["0"], ["1"])]) == 8


def test_attention_on_chinese_text_runs_and_labels_the_characters(cjk_run: Path, tmp_path, capsys):
    code, out, err = run_cli(
        capsys, "attention", str(cjk_run), "--text", "满纸荒唐言", "--out", str(tmp_path), "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["tokens"] == list("满纸荒唐言")
    assert (tmp_path / "layer-00.png").is_file() and (tmp_path / "layer-01.png").is_file()
    assert err.count("warning:") <= 1  # at most one font warning, no glyph warnings


def test_attention_text_output_says_1_token_not_1_tokens(tiny_run: Path, tmp_path, capsys):
    code, out, err = run_cli(
        capsys, "attention", str(tiny_run), "--text", "R", "--out", str(tmp_path / "maps")
    )
    assert code == 0, err
    assert "1 token: R" in out and "1 tokens" not in out
