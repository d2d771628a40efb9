"""Shared set-up for the tests of lmlab's compiled kernels."""

from __future__ import annotations

import shutil

import pytest

from lmlab.nn import quant_kernel


def require_quant_kernels(request: pytest.FixtureRequest) -> None:
    """A test module's autouse fixture body: compile (or load from the cache) lmlab's quantized
    kernels once for the module; where a C++ compiler exists they must be available (a silent
    fallback would make the module's kernel tests vacuous); forgotten again after the module."""
    quant_kernel._reset()
    ok = quant_kernel.available()
    if not ok and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"no C++ compiler: {quant_kernel.status()}")
    assert ok, quant_kernel.status()
    request.addfinalizer(quant_kernel._reset)
