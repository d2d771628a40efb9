"""lmlab.training.allocator: glibc's malloc thresholds, raised once per training process."""

import platform
import subprocess
import sys
import textwrap

import pytest

from lmlab.training import allocator, loop
from lmlab.training import trainer as trainer_module
from tests.helpers import tiny_config


class FakeLibc:
    """Records mallopt calls; answers 1 (taken) or 0 (refused)."""

    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value) -> int:
        self.calls.append((param, value.value))
        return self.answer


@pytest.fixture
def no_malloc_env(monkeypatch):
    """None of the variables that turn the tuning off or hand it to glibc's own settings."""
    for name in (allocator.OPT_OUT_ENV, "GLIBC_TUNABLES", *allocator.USER_SETTINGS_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_libc(monkeypatch, no_malloc_env):
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    monkeypatch.setattr(allocator, "_applied", None)
    return libc


def test_thresholds_go_to_mallopt_with_glibc_parameter_numbers(fake_libc):
    assert allocator.set_malloc_thresholds(3 << 20, 7 << 20)
    assert fake_libc.calls == [(-3, 3 << 20), (-1, 7 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_...
    fake_libc.answer = 0  # glibc refuses (an mmap threshold above its heap maximum)
    assert not allocator.set_malloc_thresholds(1 << 30, 1)
    for bad in ((-1, 0), (0, 2**31)):  # mallopt takes a C int: nothing wraps around
        with pytest.raises(ValueError, match="2\\*\\*31"):
            allocator.set_malloc_thresholds(*bad)


def test_keep_freed_memory_applies_once_per_process(fake_libc):
    assert allocator.keep_freed_memory()
    assert fake_libc.calls == [(-3, allocator.MMAP_THRESHOLD), (-1, allocator.TRIM_THRESHOLD)]
    assert allocator.keep_freed_memory()  # the first answer again, nothing called twice
    assert len(fake_libc.calls) == 2
    assert allocator.GLIBC_DEFAULT_MAX[0] < allocator.MMAP_THRESHOLD  # above glibc's own ceiling


@pytest.mark.parametrize(
    "env",
    [
        {"LMLAB_NO_MALLOC_TUNING": "1"},
        {"LMLAB_NO_MALLOC_TUNING": "yes"},
        {"MALLOC_TRIM_THRESHOLD_": "100000"},  # the user's own glibc settings win
        {"MALLOC_MMAP_THRESHOLD_": "100000"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=100000"},
    ],
)
def test_the_opt_out_and_a_users_own_settings_leave_malloc_alone(fake_libc, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not allocator.tuning_wanted()
    assert not allocator.keep_freed_memory()
    assert fake_libc.calls == []


def test_an_empty_or_zero_opt_out_and_other_tunables_still_tune(fake_libc, monkeypatch):
    for value in ("0", "false", "No", " off "):
        assert allocator.tuning_wanted({"LMLAB_NO_MALLOC_TUNING": value})
    assert allocator.tuning_wanted({"LMLAB_NO_MALLOC_TUNING": ""})
    assert allocator.tuning_wanted({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})


def test_another_c_library_is_left_alone(monkeypatch):
    allocator._glibc.cache_clear()
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    try:
        assert allocator._glibc() is None
        assert not allocator.set_malloc_thresholds(1 << 20, 1 << 20)
    finally:
        allocator._glibc.cache_clear()


def test_training_on_a_cpu_tunes_the_allocator(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(1) or True)
    trainer_module.train(tiny_config(train={"max_steps": 1}), out=tmp_path / "run", progress=False)
    assert calls == [1]


# A real glibc process: a 96 MiB block (above glibc's 32 MiB dynamic ceiling, so always mmap'd
# by default) written and freed 8 times. Untuned, every round's pages are new to the process
# (minor faults); tuned, the block stays in the heap and only the first round faults.
FAULTS = textwrap.dedent(
    """
    import ctypes, resource, sys
    from lmlab.training import allocator
    if sys.argv[1] == "tuned":
        assert allocator.keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 96 << 20
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(ctypes.c_void_p(p))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    """
)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_tuned_thresholds_stop_the_page_faults_of_a_block_freed_and_taken_again(no_malloc_env):
    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    untuned, tuned = faults("untuned"), faults("tuned")
    # every round faults untuned (4 KiB pages: 24,576 a round; fewer with transparent huge
    # pages), only about the first tuned
    assert tuned * 4 < untuned, (untuned, tuned)
