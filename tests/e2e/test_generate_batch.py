"""End-to-end: `lmlab generate RUN --prompt A --prompt B ...` decodes the prompts as one batch."""

from __future__ import annotations

from pathlib import Path

from lmlab.cli import main


def _generate(capsys, run: Path, *args: str) -> tuple[int, str, str]:
    code = main(["generate", str(run), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_several_prompts_print_blocks_equal_to_each_prompt_alone(tiny_run: Path, capsys):
    prompts = ["ROMEO:", "To be, or not", "K"]  # 6, 13 and 1 characters: left-padded
    common = ["--temperature", "0", "--max-new-tokens", "30"]
    argv = [a for p in prompts for a in ("--prompt", p)] + common
    code, out, err = _generate(capsys, tiny_run, *argv)
    assert code == 0, err
    alone = [_generate(capsys, tiny_run, "--prompt", p, *common)[1] for p in prompts]
    # each block is exactly what the single-prompt command prints, blocks joined by a line ---
    assert out == "---\n".join(alone)
    blocks = out.removesuffix("\n").split("\n---\n")
    assert [b[: len(p)] for b, p in zip(blocks, prompts, strict=True)] == prompts
    assert all(len(b) == len(p) + 30 for b, p in zip(blocks, prompts, strict=True))


def test_seeded_batch_repeats_and_prompt_i_samples_with_seed_plus_i(tiny_run: Path, capsys):
    args = ["--prompt", "A", "--prompt", "B", "--seed", "7", "--max-new-tokens", "25"]
    args += ["--stop", "\\n\\n", "--no-prompt"]
    code, out, err = _generate(capsys, tiny_run, *args)
    assert code == 0, err
    assert _generate(capsys, tiny_run, *args)[1] == out  # same seed, same samples
    common = ["--max-new-tokens", "25", "--stop", "\\n\\n", "--no-prompt"]
    first = _generate(capsys, tiny_run, "--prompt", "A", "--seed", "7", *common)[1]
    second = _generate(capsys, tiny_run, "--prompt", "B", "--seed", "8", *common)[1]
    assert out == first + "---\n" + second
    assert "\n\n" not in out


def test_one_prompt_streams_as_before_and_bad_prompts_name_themselves(tiny_run: Path, capsys):
    code, out, _ = _generate(capsys, tiny_run, "--prompt", "KING", "--max-new-tokens", "10")
    assert code == 0 and out.startswith("KING") and "---" not in out
    code, _, err = _generate(
        capsys, tiny_run, "--prompt", "ok", "--prompt", "x" * 40, "--max-new-tokens", "2"
    )
    assert code == 0 and "prompt 2 has 40 tokens" in err and "keeping its last 32" in err
    code, _, err = _generate(capsys, tiny_run, "--prompt", "ok", "--prompt", "Ωmega")
    assert code == 2 and err.startswith("error: ") and "'Ω'" in err
    assert len(err.strip().splitlines()) == 1
