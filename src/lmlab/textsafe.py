"""Text that came from a model or a file, made safe to print on a terminal.

A chat template's ``raise_exception`` message, a tokenizer's token, a file name or generated text
can hold control characters: ESC starts sequences that clear the screen, move the cursor, retitle
the window or fake colours; CR and backspace overwrite what was printed; a newline in an error
message fakes a second ``error:`` line. :func:`neutralise` turns every C0/C1 control character
(and the Unicode bidirectional overrides, which reorder what is shown) into a visible escape such
as ``\\x1b``, so what is printed is what was there, and nothing acts on the terminal.

- :func:`one_line`: for error messages; newlines and tabs are escaped too (one line stays one).
- :func:`for_terminal`: wraps an output stream; on a terminal (``isatty()``) generated text is
  neutralised keeping newlines and tabs, elsewhere (a pipe, a file) the model's bytes pass
  unchanged so a redirected output is exactly what the model produced.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

# C0 controls except \t and \n, DEL, C1 controls; the bidi embeddings/overrides/isolates
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def neutralise(text: str) -> str:
    """``text`` with each control character except ``\\n`` and ``\\t`` written as an escape
    (``\\x1b``, ``\\r``-> ``\\x0d``, U+202E -> ``\\u202e``); all other characters unchanged."""
    return _UNSAFE.sub(_escape, text)


def one_line(text: str) -> str:
    """:func:`neutralise` that also escapes newlines and tabs: a message that stays one line."""
    return _UNSAFE_LINE.sub(_escape, text)


class _TerminalStream:
    """Writes neutralised text to ``stream``; everything else is passed through."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(neutralise(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def for_terminal(stream: TextIO) -> TextIO:
    """``stream`` itself when it is not a terminal, else a wrapper whose ``write`` neutralises
    control characters (keeping ``\\n`` and ``\\t``). An escape sequence split across two
    writes is harmless: its ESC is escaped in the first."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    return _TerminalStream(stream) if tty else stream  # type: ignore[return-value]
