"""The CLI on a seq2seq run: eval prints exact_match, generate --source, attention --source draws
cross-attention (target tokens x source tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmlab.analysis.attention_maps import seq2seq_attention_maps
from lmlab.interop.load import load
from tests.helpers import run_cli


def test_eval_prints_exact_match_token_accuracy_and_loss(seq2seq_run: Path, capsys):
    code, out, _ = run_cli(capsys, "eval", str(seq2seq_run), "--json", "--device", "cpu")
    assert code == 0
    res = json.loads(out)
    assert set(res) == {"exact_match", "token_accuracy", "loss", "perplexity", "pairs", "tokens"}
    assert res["pairs"] == 24  # the last 10% of the 240 pairs
    assert 0.0 <= res["exact_match"] <= 1.0 and 0.0 < res["token_accuracy"] <= 1.0


def test_generate_source_prints_the_greedy_output_of_generate_seq2seq(seq2seq_run: Path, capsys):
    from lmlab.generation.generate import SamplingParams
    from lmlab.generation.seq2seq import generate_seq2seq

    model, tok = load(seq2seq_run)
    expected = tok.decode(
        generate_seq2seq(model, [tok.encode("abcd")], SamplingParams(15, temperature=0.0))[0]
    )
    code, out, _ = run_cli(
        capsys, "generate", str(seq2seq_run), "--source", "abcd", "--temperature", "0",
        "--max-new-tokens", "15", "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and out == expected + "\n"


def test_cross_attention_maps_have_target_rows_and_source_columns(seq2seq_run: Path):
    model, tok = load(seq2seq_run)
    maps = seq2seq_attention_maps(model, tok, "abcde", "edcba")
    cross = maps["cross"]
    assert len(cross.weights) == 2  # one per decoder layer
    assert all(w.shape == (4, 6, 5) for w in cross.weights)  # (H, target + </s>, source)
    assert cross.key_labels == list("abcde")
    assert cross.query_labels == [*"edcba", "</s>"]
    assert torch.allclose(cross.weights[0].sum(-1), torch.ones(4, 6), atol=1e-5)
    assert maps["encoder"].weights[0].shape == (4, 5, 5)
    dec = maps["decoder"]
    assert dec.weights[0].shape == (4, 6, 6) and dec.mask is not None
    assert float(dec.weights[0][:, 0, 1:].abs().max()) == 0.0  # causal: row 0 sees only itself


def test_attention_source_writes_cross_encoder_and_decoder_maps(
    seq2seq_run: Path, tmp_path, capsys
):
    out_dir = tmp_path / "maps"
    code, out, _ = run_cli(
        capsys, "attention", str(seq2seq_run), "--source", "abc", "--target", "cba",
        "--out", str(out_dir), "--device", "cpu",
    )  # fmt: skip
    assert code == 0
    assert "source, 3 tokens: a b c" in out and "target, 4 tokens: c b a </s>" in out
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == [
        f"{k}-layer-{i:02d}.png" for k in ("cross", "decoder", "encoder") for i in (0, 1)
    ]
