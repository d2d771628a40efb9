"""Chat with an instruction-tuned model: its own chat template, a history, and a token budget.

The template is the model's Jinja source (GGUF ``tokenizer.chat_template``, or ``chat_template``
in the ``tokenizer_config.json`` beside a run's or Hugging Face folder's tokenizer.json,
:mod:`lmlab.data.tokenizer_config`), rendered in Jinja's immutable sandbox with the variables
Hugging Face ``apply_chat_template`` passes: ``messages`` (a list of ``{"role", "content"}``),
``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``raise_exception``. A reply ends at
the model's end-of-turn token (``tokenizer.stop_ids``: eos and eot, ``<|im_end|>`` in ChatML),
which is not printed.

Token budget: the rendered conversation plus room for the reply must fit the context
(``max_context`` tokens, at most the model's ``max_seq_len``); the oldest turns (a user message
and its answer) are dropped until it does. The system message, if any, is always kept.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TextIO

from torch import nn

from lmlab.data.tokenizer import Tokenizer
from lmlab.errors import LmlabError
from lmlab.generation.generate import SamplingParams, generate_ids
from lmlab.generation.stream import StopStrings, token_text
from lmlab.textsafe import for_terminal, one_line

Message = dict[str, str]


def chat_template_of(tokenizer: Tokenizer) -> str:
    """The tokenizer's chat template. Raises LmlabError when it has none or it is not a string
    (a GGUF key or a tokenizer_config.json field of another type)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None or template == "":
        raise LmlabError(
            "this model's tokenizer has no chat template (a GGUF file's "
            "tokenizer.chat_template, or chat_template in the tokenizer_config.json beside its "
            "tokenizer.json); use --prompt for plain continuation"
        )
    if not isinstance(template, str):
        raise LmlabError(
            f"this model's chat template is a {type(template).__name__}, not Jinja source text; "
            "lmlab renders only a string template"
        )
    return template


def render_chat(
    template: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render ``messages`` with a Jinja chat template in an immutable sandbox (the template
    cannot touch Python objects or files) with bounded time, recursion and output
    (:mod:`lmlab.generation.chat_template`). Raises LmlabError if the template is not a string,
    is invalid, reaches a bound, or calls ``raise_exception``."""
    from lmlab.generation.chat_template import render_template

    def raise_exception(message: object) -> None:
        raise LmlabError(f"the chat template refused the conversation: {message}")

    variables = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    chars = sum(len(str(m.get("content", ""))) for m in messages)
    return render_template(template, variables, raise_exception, chars)


def stop_ids_of(tokenizer: Tokenizer) -> set[int]:
    """Ids that end a reply: ``tokenizer.stop_ids`` when it has them, else its eos id."""
    ids = set(getattr(tokenizer, "stop_ids", None) or ())
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return ids


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's template and the assistant's turn
    opened (``add_generation_prompt``). Special tokens in the rendered text (``<|im_start|>``)
    become their single ids."""
    text = render_chat(
        chat_template_of(tokenizer),
        messages,
        add_generation_prompt=True,
        bos_token=str(getattr(tokenizer, "bos_token", "")),
        eos_token=str(getattr(tokenizer, "eos_token", "")),
    )
    return tokenizer.encode(text)


def stream_reply(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    max_context: int,
) -> Iterator[str]:
    """Stream the assistant's reply to ``prompt_ids`` as text pieces (whole characters), ending
    at an end-of-turn id (not emitted), a stop string or ``params.max_new_tokens``. A character
    cut by the token budget is dropped, never shown as U+FFFD; one the prompt's last ids begin
    is completed by the reply's first bytes and emitted whole."""
    params.validate()
    stops = stop_ids_of(tokenizer)
    pieces, stop_strings = token_text(tokenizer, prompt_ids), StopStrings(params.stop)
    for tok in generate_ids(
        model, prompt_ids, params, max_context, tokenizer.eos_id, tokenizer.vocab_size
    ):
        if tok in stops:
            break
        text, stopped = stop_strings.push(pieces.push(tok))
        if text:
            yield text
        if stopped:
            return
    text, stopped = stop_strings.push(pieces.flush())
    tail = text if stopped else text + stop_strings.flush()
    if tail:
        yield tail


class ChatSession:
    """A conversation: an optional system message and the (user, assistant) turns so far.

    ``max_context``: tokens the prompt plus the reply may use; the prompt keeps room for
    ``min(params.max_new_tokens, max_context // 2)`` new tokens. Raises LmlabError from
    :meth:`prompt_for` when the newest message alone does not fit.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        params: SamplingParams,
        max_context: int,
        system: str | None = None,
    ) -> None:
        chat_template_of(tokenizer)  # fail early without a template
        params.validate()  # and with a bad sampling value
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.max_context = max_context
        self.system = system
        self.turns: list[tuple[str, str]] = []
        self.dropped = 0  # turns dropped so far to fit the budget

    def messages(self, user: str, turns: list[tuple[str, str]]) -> list[Message]:
        out: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in turns:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return out + [{"role": "user", "content": user}]

    def prompt_for(self, user: str) -> list[int]:
        """Prompt ids for a new user message, dropping the oldest turns to fit the budget."""
        budget = self.max_context - min(self.params.max_new_tokens, self.max_context // 2)
        alone = chat_prompt_ids(self.tokenizer, self.messages(user, []))
        if len(alone) > budget:  # refused before any turn is dropped: the history stays
            raise LmlabError(
                f"the message needs {len(alone)} tokens with the template, more than the "
                f"{budget} the context budget leaves for a prompt ({self.max_context} tokens, "
                f"{self.max_context - budget} kept for the reply); shorten it or raise "
                "--max-context"
            )
        while True:
            ids = chat_prompt_ids(self.tokenizer, self.messages(user, self.turns))
            if len(ids) <= budget or not self.turns:
                return ids
            self.turns.pop(0)
            self.dropped += 1

    def reply(self, user: str) -> Iterator[str]:
        """Stream the answer to ``user``; the turn joins the history once fully streamed."""
        ids = self.prompt_for(user)
        pieces: list[str] = []
        for piece in stream_reply(self.model, self.tokenizer, ids, self.params, self.max_context):
            pieces.append(piece)
            yield piece
        self.turns.append((user, "".join(pieces)))

    def reset(self) -> None:
        self.turns.clear()


def chat_repl(
    model: nn.Module,
    tokenizer: Tokenizer,
    params: SamplingParams,
    max_context: int,
    system: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """A read-reply loop: each line of ``stdin`` is a user message, the reply streams to
    ``stdout``. ``/reset`` clears the history, ``/exit`` or end of input (Ctrl-D) ends the chat;
    prompts and notices go to ``stderr``. Ctrl-C during a reply stops that reply only. A message
    too long for the context is refused with an ``error:`` line, the history kept, and the chat
    goes on. Returns the exit status: 0, or 2 if a message was refused. Raises LmlabError when
    ``system`` alone leaves no room for a message."""
    inp, err = stdin or sys.stdin, stderr or sys.stderr
    out = for_terminal(stdout or sys.stdout)  # a model's control characters escaped on a tty
    session = ChatSession(model, tokenizer, params, max_context, system)
    if system:  # a system message that leaves no room would refuse every message
        try:
            session.prompt_for("")
        except LmlabError as e:
            raise LmlabError(f"--system is too long: {e}") from None
    err.write("chat: /reset clears the history, /exit or Ctrl-D quits\n")
    refused = False  # a message was refused (too long): the chat went on, the exit status is 2
    while True:
        err.write("> ")
        err.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            line = ""
        except UnicodeDecodeError:  # a strict UTF-8 stdin meeting other bytes
            err.write("error: the message is not UTF-8 text; give UTF-8 text\n")
            refused = True
            continue
        if not line:  # end of input
            err.write("\n")
            return 2 if refused else 0
        text = line.rstrip("\r\n")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, passed on as lone surrogates
            err.write("error: the message is not UTF-8 text; give UTF-8 text\n")
            refused = True
            continue
        if not text.strip():
            continue
        if text.strip() == "/exit":
            return 2 if refused else 0
        if text.strip() == "/reset":
            session.reset()
            err.write("(history cleared)\n")
            continue
        if text.startswith("/"):
            err.write(f"unknown command {text.split()[0]}; commands: /reset, /exit\n")
            continue
        dropped = session.dropped
        try:
            for piece in session.reply(text):
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            err.write("\n(reply interrupted)")
        except LmlabError as e:  # e.g. a message too long for the context: say so, keep going
            err.write(f"error: {one_line(str(e))}\n")
            refused = True
            continue
        out.write("\n")
        out.flush()
        if session.dropped > dropped:
            err.write(
                f"(dropped the {session.dropped - dropped} oldest turn(s) to fit the context of "
                f"{max_context} tokens)\n"
            )
