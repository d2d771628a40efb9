"""lmlab.nn.cpp_build: a build killed half-way (torch's ``lock`` file left in the build folder)
does not make the next build wait forever, and a build held by another process is waited for
at most WAIT_S seconds."""

from __future__ import annotations

import fcntl
import os
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
        folder = cpp_build.build_dir("lmlab_test_answer", [{str(src)!r}])
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


def test_a_build_held_by_another_process_is_waited_for_only_so_long(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_build, "WAIT_S", 0.5)
    folder = cpp_build.build_dir("lmlab_test_held", [str(tmp_path / "none.cpp")])
    folder.mkdir(parents=True)
    with open(folder.with_name(folder.name + ".flock"), "a+b") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # another open file: a different holder
        with pytest.raises(TimeoutError, match="another process has been building"):
            cpp_build.build("lmlab_test_held", [str(tmp_path / "none.cpp")], [], [])
    err = capsys.readouterr().err
    assert err.count(f"lmlab: waiting for another process that is building {folder.name}") == 1


def test_a_build_folder_others_can_write_is_refused_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpp_build.build_dir("lmlab_test_open", [str(tmp_path / "none.cpp")])
    folder.mkdir(parents=True)
    folder.chmod(0o777)  # anyone could plant a library here
    with pytest.raises(PermissionError, match="not private to this user"):
        cpp_build.build("lmlab_test_open", [str(tmp_path / "none.cpp")], [], [])


def test_a_library_others_could_have_written_is_not_loaded(tmp_path, monkeypatch):
    """ninja keeps a library newer than its sources, and torch's load() dlopens it: a planted
    or group-writable one must be refused before that, not after its constructor ran."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpp_build.build_dir("lmlab_test_planted", [str(tmp_path / "none.cpp")])
    folder.mkdir(parents=True)
    planted = folder / (folder.name + ".so")
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    with pytest.raises(PermissionError, match=rf"{folder.name}\.so is not private"):
        cpp_build.build("lmlab_test_planted", [str(tmp_path / "none.cpp")], [], [])
    if os.getuid() == 0:  # as root: a library owned by another user, mode 644
        planted.chmod(0o644)
        os.chown(planted, 12345, -1)
        with pytest.raises(PermissionError, match="owner uid 12345"):
            cpp_build.build("lmlab_test_planted", [str(tmp_path / "none.cpp")], [], [])


def test_folders_are_made_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "root"))
    old = os.umask(0o002)  # a common user umask: group-writable by default
    try:
        with pytest.raises(OSError):  # the source does not exist: the build itself fails
            cpp_build.build("lmlab_test_umask", [str(tmp_path / "none.cpp")], [], [])
    finally:
        os.umask(old)
    folder = cpp_build.build_dir("lmlab_test_umask", [str(tmp_path / "none.cpp")])
    assert folder.stat().st_mode & 0o022 == 0 and folder.parent.stat().st_mode & 0o022 == 0


def test_two_checkouts_build_into_folders_of_their_own_and_the_first_build_says_so(
    tmp_path, monkeypatch, capsys
):
    # ninja rebuilds a library whose build command changed: two clones sharing one folder (the
    # same name, other source paths) recompiled every kernel each time the other had run
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    paths = []
    for clone in ("a", "b"):
        (tmp_path / clone).mkdir()
        src = tmp_path / clone / "answer.cpp"
        src.write_text(SOURCE)
        paths.append(cpp_build.build("lmlab_test_clones", [str(src)], ["-O1"], []))
    assert paths[0].parent != paths[1].parent
    assert paths[0].parent == cpp_build.build_dir("lmlab_test_clones", [str(tmp_path / "a" / "x")])
    err = capsys.readouterr().err
    assert err.count("lmlab: compiling lmlab_test_clones_") == 2
    again = cpp_build.build("lmlab_test_clones", [str(tmp_path / "a" / "answer.cpp")], ["-O1"], [])
    assert again == paths[0] and "compiling" not in capsys.readouterr().err  # cached: silent
