"""Bad input to seq2seq training, eval, generate and attention: one clear message each."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.cli import main
from lmlab.data.pairs import load_pairs
from lmlab.errors import LmlabError
from tests.helpers import seq2seq_run_config


def one_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("p.tsv", "ab\tba\nabc cba\n", "p.tsv:2: expected source<TAB>target (one tab), found 0"),
        ("p.tsv", "ab\tba\n\nx\ty\tz\n", "p.tsv:3: expected source<TAB>target (one tab), found 2"),
        ("p.tsv", "ab\tba\n\tba\n", "p.tsv:2: empty source"),
        (
            "p.jsonl",
            '{"source": "a", "target": "b"}\n{"source": "a"\n',
            "p.jsonl:2: not valid JSON",
        ),
        ("p.jsonl", '{"source": "a", "target": 3}\n', "p.jsonl:1: target missing or not a string"),
        ("p.jsonl", '["a", "b"]\n', "p.jsonl:1: expected an object"),
        ("p.tsv", "ab\tba\n", "has 1 pair(s): too few to split"),
    ],
)
def test_bad_pair_files_name_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(LmlabError) as e:
        load_pairs(path)
    assert message in str(e.value)


def test_unknown_synthetic_task_lists_the_known_ones():
    with pytest.raises(
        LmlabError, match="unknown synthetic task 'synthetic:sort'.*synthetic:reverse"
    ):
        load_pairs("synthetic:sort")


def test_seq2seq_objective_refuses_a_decoder_and_a_char_tokenizer(tmp_path):
    cfg = seq2seq_run_config("synthetic:reverse").to_dict()
    from lmlab.config import config_from_dict

    dec = dict(cfg, model=dict(cfg["model"], kind="decoder"))
    with pytest.raises(
        LmlabError, match="train.objective=seq2seq needs model.kind encoder_decoder"
    ):
        config_from_dict(dec).validate()
    char = dict(cfg, data=dict(cfg["data"], tokenizer={"kind": "char"}))
    with pytest.raises(LmlabError, match="special_tokens=seq2seq"):
        config_from_dict(char).validate()


def test_a_pair_longer_than_the_context_names_the_pair(tmp_path):
    from lmlab.training.trainer import train

    path = tmp_path / "p.tsv"
    path.write_text("ab\tba\n" * 5 + "a" * 20 + "\tb\n" + "ab\tba\n" * 5, encoding="utf-8")
    with pytest.raises(
        LmlabError, match="pair 6: the source has 20 tokens, more than model.max_seq_len=16"
    ):
        train(seq2seq_run_config(path, max_steps=1), out=tmp_path / "run", progress=False)


def test_generate_source_on_a_decoder_and_prompt_on_a_seq2seq_run(
    tiny_run: Path, seq2seq_run: Path, capsys
):
    err = one_error(capsys, "generate", str(tiny_run), "--source", "ROMEO")
    assert "--source needs an encoder-decoder (seq2seq) model" in err and "--prompt" in err
    err = one_error(capsys, "generate", str(seq2seq_run), "--prompt", "abc")
    assert "model.kind=encoder_decoder: use lmlab generate" in err and "--source" in err


def test_a_source_longer_than_the_encoder_context(seq2seq_run: Path, capsys):
    err = one_error(capsys, "generate", str(seq2seq_run), "--source", "a" * 17)
    assert "--source is 17 tokens, longer than the encoder context of 16 tokens" in err
    err = one_error(capsys, "attention", str(seq2seq_run), "--source", "a" * 17, "--no-plot")
    assert "17 tokens" in err and "16" in err


def test_attention_needs_source_for_seq2seq_and_text_for_decoders(
    tiny_run: Path, seq2seq_run: Path, capsys
):
    err = one_error(capsys, "attention", str(seq2seq_run), "--text", "abc", "--no-plot")
    assert "give --source TEXT" in err
    err = one_error(capsys, "attention", str(tiny_run), "--source", "abc", "--no-plot")
    assert "--source needs an encoder-decoder" in err
    err = one_error(capsys, "attention", str(tiny_run), "--no-plot")
    assert "give --text" in err
