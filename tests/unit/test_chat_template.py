"""The chat-template sandbox's deadline and bounds, as units."""

from __future__ import annotations

import time

import pytest

from lmlab.errors import LmlabError
from lmlab.generation import chat_template
from lmlab.generation.chat import render_chat
from tests.helpers import CHATML, within


def test_the_deadline_fires_again_after_a_swallowed_timeout():
    # a _Timeout raised inside a weakref callback or __del__ is lost; the watchdog repeats it
    swallowed = 0
    start = time.monotonic()
    with within(10), pytest.raises(chat_template._Timeout), chat_template._deadline(0.1):
        while True:
            try:
                while True:
                    pass
            except chat_template._Timeout:
                swallowed += 1
                if swallowed == 2:
                    raise
    assert swallowed == 2 and time.monotonic() - start < 5


def test_no_timeout_is_left_pending_after_the_block():
    with chat_template._deadline(0.05):
        pass
    time.sleep(0.2)  # a timeout raised now would fail this test


def test_chatml_renders_within_the_bounds():
    out = render_chat(CHATML, [{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_conversation_widens_the_size_bound():
    content = "x" * (chat_template.MAX_OUTPUT_CHARS // 2)
    messages = [{"role": "user", "content": content}] * 3  # 1.5 MiB of messages
    assert len(render_chat(CHATML, messages)) > chat_template.MAX_OUTPUT_CHARS
    with pytest.raises(LmlabError, match="output exceeds"):
        render_chat("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", messages[:1])
