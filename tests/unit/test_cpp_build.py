"""lmlab.nn.cpp_build: a build killed half-way (torch's ``lock`` file left in the build folder)
does not make the next build wait forever, and a build held by another process is waited for
at most WAIT_S seconds."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmlab.nn import cpp_build

SOURCE = 'extern "C" int lmlab_answer() { return 42; }\n'


def test_a_dead_builds_lock_file_is_not_waited_for(tmp_path: Path):
    src = tmp_path / "answer.cpp"
    src.write_text(SOURCE)
    script = textwrap.dedent(
        f"""
        import ctypes, os
        os.environ["TORCH_EXTENSIONS_DIR"] = {str(tmp_path / "ext")!r}
        from lmlab.nn import cpp_build
        folder = cpp_build.build_dir("lmlab_test_answer")
        folder.mkdir(parents=True)
        (folder / "lock").write_text("")  # what a build killed while compiling leaves behind
        path = cpp_build.build("lmlab_test_answer", [{str(src)!r}], ["-O1"], [])
        assert path.parent == folder, (path, folder)
        print(ctypes.CDLL(str(path)).lmlab_answer())
        """
    )
    # in a child with a time limit: torch's load alone would sleep on that lock file forever
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "42"


def test_a_build_held_by_another_process_is_waited_for_only_so_long(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_build, "WAIT_S", 0.5)
    folder = cpp_build.build_dir("lmlab_test_held")
    folder.mkdir(parents=True)
    with open(folder.with_name("lmlab_test_held.flock"), "a+b") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # another open file: a different holder
        with pytest.raises(TimeoutError, match="another process has been building"):
            cpp_build.build("lmlab_test_held", [str(tmp_path / "none.cpp")], [], [])
