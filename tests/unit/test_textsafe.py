"""lmlab.textsafe: text from a model or a file cannot act on the terminal it is printed to."""

from __future__ import annotations

import io

from lmlab.textsafe import for_terminal, neutralise, one_line


def test_neutralise_escapes_every_control_character_but_newline_and_tab():
    text = "a\x1b[2J\x1b]0;title\x07b\rc\x08\x7f\x9b\u202eZ\n\tok"
    assert neutralise(text) == "a\\x1b[2J\\x1b]0;title\\x07b\\x0dc\\x08\\x7f\\x9b\\u202eZ\n\tok"


def test_one_line_keeps_a_message_on_one_line():
    assert one_line("x\nerror: fake\tend") == "x\\nerror: fake\\tend"


def test_plain_text_is_unchanged():
    text = "Grüße, 中文, emoji 🎉 and punctuation !?"
    assert neutralise(text) == one_line(text) == text


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_for_terminal_escapes_on_a_tty_and_passes_bytes_through_elsewhere():
    tty, pipe = _Tty(), io.StringIO()
    for_terminal(tty).write("\x1b[31mred")
    assert tty.getvalue() == "\\x1b[31mred"
    assert for_terminal(pipe) is pipe
