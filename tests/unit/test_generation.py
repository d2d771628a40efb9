import math
from pathlib import Path

import pytest
import torch

from lmlab.config import TokenizerConfig
from lmlab.data.tokenizer import train_tokenizer
from lmlab.generation.chat import stream_reply
from lmlab.generation.generate import (
    SamplingParams,
    generate_ids,
    generate_text,
    generate_texts,
)
from lmlab.generation.sampling import (
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    next_token,
)
from lmlab.generation.stream import StopStrings, Utf8Stream, unescape
from lmlab.models import ModelOutput, build_model
from lmlab.nn.kv_cache import KVCache
from tests.helpers import tiny_model_config


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = apply_top_k(logits, 2)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = apply_top_p(probs.log(), 0.75)  # 0.5 + 0.3 >= 0.75: two tokens
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = apply_top_p(probs.log(), 0.1)  # always at least one
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_temperature_zero_is_greedy_and_seeded_sampling_repeats():
    logits = torch.tensor([0.1, 3.0, 0.2])
    assert next_token(logits, torch.tensor([]), temperature=0.0) == 1
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [next_token(logits, torch.tensor([]), 2.0, generator=g1) for _ in range(20)]
    b = [next_token(logits, torch.tensor([]), 2.0, generator=g2) for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_utf8_stream_never_emits_half_a_character():
    s = Utf8Stream()
    data = "é世".encode()
    pieces = [s.push(data[i : i + 1]) for i in range(len(data))]
    assert pieces == ["", "é", "", "", "世"]
    assert s.flush() == ""


def test_stop_strings_hold_back_prefixes_and_cut_the_stop():
    s = StopStrings(["\n\n", "END"])
    assert s.push("Hello E") == ("Hello ", False)
    assert s.push("N") == ("", False)
    assert s.push("Dless") == ("", True)
    s = StopStrings(["END"])
    assert s.push("EN") == ("", False)
    assert s.push("ough") == ("ENough", False)


def _tiny_lm(vocab: int, max_seq_len: int = 16):
    return build_model(tiny_model_config(vocab_size=vocab, max_seq_len=max_seq_len)).eval()


def test_cached_greedy_generation_equals_recomputation():
    model = _tiny_lm(40, max_seq_len=64)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    cached = list(generate_ids(model, prompt, params, 64))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached == ids[len(prompt) :]


def test_generation_runs_past_the_context_window():
    model = _tiny_lm(40, max_seq_len=8)
    out = list(generate_ids(model, [1, 2, 3], SamplingParams(max_new_tokens=30, seed=0), 8))
    assert len(out) == 30


class Scripted(torch.nn.Module):
    """A stand-in LM that emits a fixed token script (logits one-hot on the next token)."""

    def __init__(self, vocab: int, script: list[int]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.script, self.calls = vocab, script, 0

    def new_cache(self) -> KVCache:
        return KVCache(0)

    def forward(self, x, cache=None, last_only=False, **masks):
        logits = torch.full((x.shape[0], 1, self.vocab), -1e9)  # every row follows the script
        logits[:, 0, self.script[min(self.calls, len(self.script) - 1)]] = 0.0
        self.calls += 1
        return ModelOutput(logits)


def test_generate_text_streams_whole_characters_and_stops_at_eos():
    tok = train_tokenizer(
        "世界和平。Hello world!\n" * 30, TokenizerConfig(kind="bpe", vocab_size=270)
    )
    byte_id = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    script = [byte_id[bytes([b])] for b in "世!".encode()] + [tok.eos_id, byte_id[b"x"]]
    pieces = list(
        generate_text(
            Scripted(tok.vocab_size, script),
            tok,
            "Hi",
            SamplingParams(max_new_tokens=20, temperature=0.0),
            32,
        )
    )
    assert pieces == ["世", "!"]  # three byte tokens make one character; nothing after EOS


def test_generate_text_cuts_at_stop_string_and_truncates_long_prompts():
    tok = train_tokenizer("abc\n" * 30, TokenizerConfig(kind="char"))
    ids = tok.encode("ab\nc\nab")
    out = "".join(
        generate_text(
            Scripted(tok.vocab_size, ids),
            tok,
            "a",
            SamplingParams(max_new_tokens=20, temperature=0.0, stop=["c\n"]),
            32,
        )
    )
    assert out == "ab\n"
    warnings: list[str] = []
    list(
        generate_text(
            Scripted(tok.vocab_size, ids),
            tok,
            "abc" * 20,
            SamplingParams(max_new_tokens=1),
            32,
            warn=warnings.append,
        )
    )
    assert warnings == [
        "the prompt has 60 tokens, more than the context of 32; keeping its last 32 tokens"
    ]


def test_sampling_params_are_validated():
    from lmlab.errors import LmlabError

    for bad, msg in [
        ({"top_p": 0.0}, "--top-p"),
        ({"temperature": -1.0}, "--temperature"),
        ({"max_new_tokens": -1}, "--max-new-tokens"),
        ({"top_k": -2}, "--top-k"),
        ({"repetition_penalty": 0.0}, "--repetition-penalty"),
    ]:
        with pytest.raises(LmlabError, match=msg):
            SamplingParams(**bad).validate()
    assert math.isclose(SamplingParams().temperature, 0.8)


BAD_SAMPLING = [
    ({"temperature": -1.0}, "--temperature must be >= 0"),
    ({"temperature": math.nan}, "--temperature must be a finite number"),
    ({"temperature": math.inf}, "--temperature must be a finite number"),
    ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"--top-p must be in \(0, 1\]"),
    ({"top_p": math.nan}, "--top-p must be a finite number"),
    ({"top_k": -1}, "--top-k must be >= 0"),
    ({"top_k": 2.5}, "--top-k must be an integer"),
    ({"repetition_penalty": 0.0}, "--repetition-penalty must be > 0"),
    ({"repetition_penalty": -2.0}, "--repetition-penalty must be > 0"),
    ({"repetition_penalty": math.inf}, "--repetition-penalty must be a finite number"),
]


def _call_next_token(bad):
    values = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **bad}
    next_token(torch.tensor([0.1, 3.0, 0.2]), torch.tensor([1]), **values)


def _call_processor(bad):
    (name, value), logits, history = next(iter(bad.items())), torch.randn(5), torch.tensor([1])
    if name == "top_k":
        apply_top_k(logits, value)
    elif name == "top_p":
        apply_top_p(logits, value)
    elif name == "repetition_penalty":
        apply_repetition_penalty(logits, history, value)
    else:  # temperature has no processor of its own: next_token divides by it
        _call_next_token(bad)


def _call_generate_ids(bad):
    model = build_model(tiny_model_config(vocab_size=20)).eval()
    generate_ids(model, [1, 2], SamplingParams(max_new_tokens=3, **bad), 16)  # not iterated


def _call_generate_batch(bad):
    from lmlab.generation.generate import generate_batch

    model = build_model(tiny_model_config(vocab_size=20)).eval()
    generate_batch(model, [[1, 2]], SamplingParams(max_new_tokens=3, **bad), 16)


ENTRY_POINTS = {
    "SamplingParams.validate": lambda bad: SamplingParams(**bad).validate(),
    "next_token": _call_next_token,
    "apply_top_k / apply_top_p / apply_repetition_penalty": _call_processor,
    "generate_ids (when called)": _call_generate_ids,
    "generate_batch": _call_generate_batch,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(("bad", "message"), BAD_SAMPLING, ids=lambda v: str(v))
def test_every_sampling_entry_point_refuses_bad_values(entry, bad, message):
    from lmlab.errors import LmlabError

    with pytest.raises(LmlabError, match=message):
        ENTRY_POINTS[entry](bad)


def test_top_k_above_the_vocabulary_keeps_every_token():
    logits = torch.randn(7)
    assert torch.equal(apply_top_k(logits, 7), logits)
    assert torch.equal(apply_top_k(logits, 10**9), logits)
    g = torch.Generator().manual_seed(0)
    assert 0 <= next_token(logits, torch.tensor([]), 1.0, top_k=10**9, generator=g) < 7


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e-300, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_tiny_temperature_acts_as_greedy_never_nan(temperature, dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = (torch.randn(50) * 10).to(dtype)
        greedy = next_token(logits, torch.tensor([]), 0.0)
        for top_k, top_p in ((0, 1.0), (5, 0.9)):
            assert next_token(logits, torch.tensor([]), temperature, top_k, top_p, generator=g) == (
                greedy
            )


def test_generation_at_a_tiny_temperature_equals_greedy_generation():
    model = build_model(tiny_model_config(vocab_size=40)).eval()
    greedy = list(generate_ids(model, [3, 1, 4], SamplingParams(12, temperature=0.0), 32))
    tiny = list(generate_ids(model, [3, 1, 4], SamplingParams(12, temperature=5e-324, seed=1), 32))
    assert tiny == greedy


@pytest.mark.parametrize("penalty", [1e-45, 5e-324, 1e300])
def test_an_extreme_repetition_penalty_never_makes_logits_or_probabilities_nan(penalty):
    logits = torch.tensor([-3.0, 0.0, 2.0, 5.0, -1.0])
    history = torch.tensor([0, 1, 2, 4])
    out = apply_repetition_penalty(logits, history, penalty)
    assert bool(out.isfinite().all())
    assert out[3] == logits[3]  # a token not in the history is untouched
    g = torch.Generator().manual_seed(0)
    for temperature in (0.0, 0.8, 1e-45):
        tok = next_token(logits, history, temperature, repetition_penalty=penalty, generator=g)
        assert 0 <= tok < 5


def test_float64_logits_are_not_rounded_to_float32():
    logits = torch.tensor([1.0, 1.0 + 1e-12, 0.5], dtype=torch.float64)  # equal in float32
    assert next_token(logits, torch.tensor([]), 0.0) == 1
    assert next_token(logits, torch.tensor([0]), 0.0, repetition_penalty=1.0 + 1e-13) == 1


def test_stop_strings_typed_with_escapes_mean_control_characters():
    assert unescape("\\n\\n") == "\n\n"
    assert unescape("a\\tb\\\\n") == "a\tb\\n"
    assert unescape("日本\\x") == "日本\\x"


HONGLOUMENG = Path("/work/shared/data/hongloumeng/hongloumeng.txt")


def _chinese_bpe():
    """A byte-level BPE fitted on the first lines of 红楼梦 (or, without the file, a few
    hand-written lines), small enough that rarer characters stay split into byte tokens."""
    if HONGLOUMENG.is_file():
        text = "\n".join(HONGLOUMENG.read_text(encoding="utf-8").splitlines()[:3])
    else:
        text = "第一回　甄士隐梦幻识通灵　贾雨村风尘怀闺秀\n此开卷第一回也。作者自云。\n" * 3
    return train_tokenizer(text, TokenizerConfig(kind="bpe", vocab_size=300))


def _split_character(tok) -> tuple[str, list[int]]:
    """A CJK character that the tokenizer spells with more than one id, and those ids."""
    for c in "甄士隐梦幻识通灵贾雨村风尘怀闺秀卷":
        ids = tok.encode(c)
        if len(ids) > 1:
            return c, ids
    raise AssertionError("every character is one token; lower the vocabulary size")


def test_generation_cut_inside_a_character_drops_it_and_says_so():
    tok = _chinese_bpe()
    whole = tok.encode("一")
    char, ids = _split_character(tok)
    script = whole + ids  # "一" then a multi-id character, cut after its first id
    params = SamplingParams(max_new_tokens=len(whole) + 1, temperature=0.0)
    warnings: list[str] = []
    model = Scripted(tok.vocab_size, script)
    out = "".join(generate_text(model, tok, "第", params, 32, warn=warnings.append))
    assert out == "一", repr(out)  # no U+FFFD for the cut character
    assert len(warnings) == 1 and f"dropped {len(tok.token_bytes(ids[0]))} generated" in warnings[0]
    model = Scripted(tok.vocab_size, script)
    texts = generate_texts(model, tok, ["第", "回"], params, 32, warn=warnings.append)
    assert texts == ["一", "一"]
    model = Scripted(tok.vocab_size, script)
    reply = "".join(stream_reply(model, tok, tok.encode("第"), params, 32))
    assert reply == "一"


def test_a_character_begun_by_the_prompt_ids_is_completed_not_replaced():
    tok = _chinese_bpe()
    char, ids = _split_character(tok)
    model = Scripted(tok.vocab_size, ids[1:])  # the reply's first ids finish the character
    params = SamplingParams(max_new_tokens=len(ids) - 1, temperature=0.0)
    reply = "".join(stream_reply(model, tok, tok.encode("第") + ids[:1], params, 32))
    assert reply == char


def test_utf8_stream_drops_invalid_and_unfinished_bytes():
    s = Utf8Stream()
    assert s.push(b"\x80a\xe4\xb8") == "a"  # a stray continuation byte, then half of 世
    assert s.push(b"\x96") == "世"
    assert s.push(b"\xe4") == "" and s.flush() == ""
    assert s.dropped == 2


def test_stop_strings_treat_windows_line_endings_as_newlines():
    s = StopStrings(["\n\n"])  # a model that learnt "\r\n" from a Windows corpus
    assert s.push("one\r") == ("one", False)  # "\r" waits: "\n" may follow
    assert s.push("\ntwo\r\n") == ("\ntwo", False)
    assert s.push("\r\nthree") == ("", True)
    s = StopStrings(["\n"])
    assert s.push("a\r") == ("a", False) and s.flush() == ""  # a final "\r" ends the line
    s = StopStrings([])
    assert s.push("a\r\nb\r") == ("a\nb", False) and s.flush() == "\n"


def test_seq2seq_output_cut_inside_a_character_has_no_replacement_character():
    from lmlab.generation.seq2seq import _text

    tok = _chinese_bpe()
    char, ids = _split_character(tok)
    assert "\ufffd" in tok.decode(tok.encode("一") + ids[:1])  # what a plain decode gives
    assert _text(tok, tok.encode("一") + ids[:1]) == "一"
    assert _text(tok, tok.encode("一") + ids) == "一" + char


def _metaspace_byte_fallback_tokenizer():
    """A Llama-2 / Mistral style tokenizer.json (data.tokenizer.kind hf): Metaspace "▁" for
    spaces and <0xNN> byte-fallback tokens for characters outside its merges."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from lmlab.data.tokenizer import PretrainedTokenizer

    hf = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    hf.train_from_iterator(["hello world, the cat sat on the mat"] * 20, trainer)
    return PretrainedTokenizer(hf)


def test_a_metaspace_byte_fallback_tokenizer_streams_its_decoded_text():
    tok = _metaspace_byte_fallback_tokenizer()
    script = tok.encode(" world 世界")  # "▁world", "▁", then six <0xNN> byte tokens
    assert any(tok.token_bytes(i).startswith(b"<0x") for i in script)
    params = SamplingParams(max_new_tokens=len(script), temperature=0.0)
    out = "".join(generate_text(Scripted(tok.vocab_size, script), tok, "hello", params, 32))
    assert out == " world 世界"  # spaces, not "▁"; characters, not "<0xE4>"
    warnings: list[str] = []
    cut = SamplingParams(max_new_tokens=len(script) - 1, temperature=0.0)
    model = Scripted(tok.vocab_size, script)
    out = "".join(generate_text(model, tok, "hello", cut, 32, warn=warnings.append))
    assert out == " world 世" and len(warnings) == 1  # the cut 界 is dropped, said so


def test_a_model_padded_wider_than_its_tokenizer_never_samples_an_id_without_text():
    # Hugging Face models often pad the vocabulary (an embedding wider than the tokenizer's);
    # an id past the tokenizer has no text: generation must never pick one (it used to crash
    # the char tokenizer with "error: unexpected IndexError").
    tok = train_tokenizer("abc\n" * 30, TokenizerConfig(kind="char"))
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size + 6)).eval()
    v = tok.vocab_size

    def favour_padding(module, args, out):  # make the padded ids the most likely ones
        out.logits[..., v:] += 100.0

    model.register_forward_hook(favour_padding)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    ids = list(generate_ids(model, [0], greedy, 32))
    assert any(i >= tok.vocab_size for i in ids)  # unlimited, the padded ids do win
    limited = list(generate_ids(model, [0], greedy, 32, n_tokens=tok.vocab_size))
    assert limited and all(i < tok.vocab_size for i in limited)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    assert len("".join(generate_text(model, tok, "ab", sampled, 32))) > 0
    assert all(len(t) > 0 for t in generate_texts(model, tok, ["a", "bc"], sampled, 32))


def _next_token_gathering_finite(logits, temperature, top_k, top_p, generator):
    """next_token as it was before its overflow test stopped gathering the finite entries:
    the reference for the cheaper test."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scaled = logits / temperature
    if not bool(scaled[logits.isfinite()].isfinite().all()):
        return int(torch.argmax(logits))
    probs = torch.softmax(apply_top_p(apply_top_k(scaled, top_k), top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_overflow_test_picks_what_gathering_the_finite_logits_picked(dtype):
    # -inf entries (a vocabulary masked past the tokenizer's, a top-k) with an ordinary
    # temperature must sample, not fall back to greedy; temperatures where only some finite
    # logits overflow must act as greedy; the same seed must give the same tokens
    torch.manual_seed(0)
    for case in range(60):
        logits = torch.randn(64) * 10 ** (case % 4)
        logits[torch.randperm(64)[: case % 7]] = float("-inf")
        logits = logits.to(dtype)
        for temperature in (0.7, 1.0, 1e-30, 1e-38, 1e-300, 5e-324):
            for top_k, top_p in ((0, 1.0), (5, 0.9)):
                g1 = torch.Generator().manual_seed(case)
                g2 = torch.Generator().manual_seed(case)
                got = [next_token(logits, torch.tensor([]), temperature, top_k, top_p, 1.0, g1)
                       for _ in range(3)]  # fmt: skip
                want = [_next_token_gathering_finite(logits, temperature, top_k, top_p, g2)
                        for _ in range(3)]  # fmt: skip
                assert got == want, (case, temperature, top_k, top_p)


def test_a_temperature_float32_cannot_hold_is_refused_like_inf():
    from lmlab.errors import LmlabError
    from lmlab.generation.sampling import check_temperature

    check_temperature(3e38)  # still a float32 number: a very flat but proper distribution
    for t in (1e39, 1e308, float("inf")):
        with pytest.raises(LmlabError, match="--temperature must be"):
            check_temperature(t)
