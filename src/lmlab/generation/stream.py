"""Turning a token stream into text: whole UTF-8 characters only, and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class Utf8Stream:
    """Feed token bytes, get text back; an incomplete UTF-8 sequence is held until completed."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopStrings:
    """Holds back text that could begin a stop string; reports when one appears.

    ``push(text) -> (safe text to emit, stopped)``; the stop string itself is never emitted.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def unescape(text: str) -> str:
    """Turn the escapes ``\\n``, ``\\t`` and ``\\\\`` typed on a command line into a newline,
    a tab and a backslash (so ``--stop "\\n\\n"`` means a blank line); other text is unchanged."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
