"""lmlab.safeio: each reader refuses what is not a regular file of bounded size, without
blocking, and parses JSON strictly; ``inside`` keeps a name read from a file inside its folder."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmlab import safeio
from lmlab.errors import DataError, LmlabError


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    def fail(signum: int, frame: object) -> None:
        raise TimeoutError("a safeio reader blocked")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


READERS = [safeio.read_bytes, safeio.read_text, safeio.read_json, safeio.read_json_object]


@pytest.mark.parametrize("read", READERS)
def test_a_fifo_is_refused_without_blocking(tmp_path, read):
    os.mkfifo(tmp_path / "f")  # open() would wait for a writer forever
    with pytest.raises(LmlabError, match=r"f is a FIFO \(named pipe\), not a regular file"):
        read(tmp_path / "f", "state file")


@pytest.mark.parametrize("read", READERS)
def test_a_character_device_is_refused(read):
    with pytest.raises(LmlabError, match="/dev/zero is a character device"):
        read("/dev/zero")


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(LmlabError, match="is a folder, not a regular file"):
        safeio.read_text(tmp_path)


def test_a_symlink_loop_is_refused(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(LmlabError, match="a is a symlink loop"):
        safeio.read_text(tmp_path / "a")


def test_a_missing_file_names_what_it_is():
    with pytest.raises(DataError, match="tokenizer file not found: /nonexistent/t.json"):
        safeio.regular_file("/nonexistent/t.json", "tokenizer file", error=DataError)


def test_a_file_over_the_bound_is_refused_before_reading(tmp_path):
    huge = tmp_path / "huge"
    huge.write_bytes(b"")
    os.truncate(huge, 100 << 30)  # sparse: 100 GB that use no disk
    with pytest.raises(LmlabError, match="107,374,182,400 bytes, more than the 16,777,216"):
        safeio.read_bytes(huge)
    assert safeio.regular_file(huge, max_bytes=None).st_size == 100 << 30  # None: any size


def test_the_bound_is_inclusive(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert safeio.read_bytes(tmp_path / "f", max_bytes=10) == b"x" * 10
    with pytest.raises(LmlabError, match="10 bytes, more than the 9"):
        safeio.read_bytes(tmp_path / "f", max_bytes=9)


def test_the_error_class_is_the_callers(tmp_path):
    with pytest.raises(DataError):
        safeio.read_text(tmp_path / "missing", error=DataError)


def test_text_must_be_utf8_and_a_bom_is_dropped(tmp_path):
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbfhi")
    assert safeio.read_text(tmp_path / "bom") == "hi"
    (tmp_path / "latin").write_bytes(b"caf\xe9")
    with pytest.raises(LmlabError, match=r"latin is not UTF-8 text \(byte 3\)"):
        safeio.read_text(tmp_path / "latin")


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"loss": NaN}', "NaN is not a JSON number"),
        ('{"loss": Infinity}', "Infinity is not a JSON number"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": {"b": 1, "b": 1}}', "duplicate key 'b'"),
        ('{"a": ', "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_json_is_strict(tmp_path, text, problem):
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(LmlabError, match=problem):
        safeio.read_json(tmp_path / "s.json", "state file")


def test_json_object_is_required_at_the_top(tmp_path):
    (tmp_path / "s.json").write_text("[1, 2]")
    assert safeio.read_json(tmp_path / "s.json") == [1, 2]
    with pytest.raises(LmlabError, match="must hold a JSON object, not list"):
        safeio.read_json_object(tmp_path / "s.json")


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "", "a\x00b"])
def test_inside_refuses_names_that_leave_the_folder(tmp_path, name):
    with pytest.raises(LmlabError, match="not a path inside"):
        safeio.inside(tmp_path, name, "index.json")


def test_inside_refuses_a_symlink_out_of_the_folder(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "secret").write_text("s")
    (tmp_path / "run" / "weights").symlink_to(tmp_path / "secret")
    with pytest.raises(LmlabError, match="leads outside"):
        safeio.inside(tmp_path / "run", "weights", "index.json")


def test_inside_keeps_a_name_inside(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"")
    assert safeio.inside(tmp_path, "sub/w.bin", "index.json") == tmp_path / "sub" / "w.bin"
    (tmp_path / "link").symlink_to(tmp_path / "sub")  # a symlink that stays inside is fine
    assert safeio.inside(tmp_path, "link/w.bin", "index.json") == tmp_path / "link" / "w.bin"


def test_inside_refuses_a_symlink_loop(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(LmlabError, match="loop"):
        safeio.inside(tmp_path, "loop", "index.json")


def test_paths_may_be_str_or_path(tmp_path):
    (tmp_path / "o.json").write_text('{"a": 1}')
    assert safeio.read_json_object(str(tmp_path / "o.json")) == {"a": 1}
    assert safeio.read_json_object(Path(tmp_path / "o.json")) == {"a": 1}


# ----------------------------------------------------------------------------- YAML


def test_yaml_merge_keys_override_without_counting_as_duplicates():
    text = "base: &b {x: 1, y: 2}\nv: {<<: *b, y: 3}\n"
    assert safeio.parse_yaml(text, "t") == {"base": {"x": 1, "y": 2}, "v": {"x": 1, "y": 3}}


def test_yaml_duplicate_key_names_key_and_line():
    with pytest.raises(LmlabError, match=r"t repeats the key 'b' in one mapping \(line 3\)"):
        safeio.parse_yaml("a: 1\nb: 2\nb: 3\n", "t")


def test_yaml_alias_expansion_is_counted_without_expanding():
    """Nine levels of ten aliases (10**9 leaves) are measured and refused at once; a shared
    anchor used a few times stays allowed."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 9)]
    t0 = time.perf_counter()
    with pytest.raises(LmlabError, match=f"more than {safeio.YAML_MAX_NODES:,} YAML values"):
        safeio.parse_yaml("\n".join(lines), "t")
    assert time.perf_counter() - t0 < 2.0
    assert safeio.parse_yaml("\n".join(lines[:3]), "t")["l2"][9][9] == ["x"] * 10  # 1,000 leaves


def test_yaml_within_the_node_bound_is_read(monkeypatch):
    monkeypatch.setattr(safeio, "YAML_MAX_NODES", 2_000)  # the rule, not PyYAML's speed, is tested
    n = safeio.YAML_MAX_NODES - 10
    assert len(safeio.parse_yaml("[" + ",".join(["1"] * n) + "]", "t")) == n
    with pytest.raises(LmlabError, match="YAML values"):
        safeio.parse_yaml("[" + ",".join(["1"] * (safeio.YAML_MAX_NODES + 1)) + "]", "t")
