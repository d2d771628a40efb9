"""Every C++ kernel library compiles where a C++ compiler is: a build error would otherwise
turn the kernels' tests into skips (their ``needs_kernel`` marks) and training into torch's
ops, and a green run would hide it."""

from __future__ import annotations

import importlib
import shutil

import pytest

from lmlab.envflags import opted_out
from lmlab.nn import cpp_build

COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
@pytest.mark.skipif(opted_out(cpp_build.ENV_OFF), reason=f"{cpp_build.ENV_OFF} is set")
@pytest.mark.parametrize("module", ["train_kernel", "rope_kernel", "decode_kernel", "quant_kernel"])
def test_every_kernel_library_compiles_where_a_compiler_is(module):
    kernel = importlib.import_module(f"lmlab.nn.{module}")
    assert kernel.available(), f"lmlab.nn.{module}: {kernel.status()}"
