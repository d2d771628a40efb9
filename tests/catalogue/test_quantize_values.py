"""Bad ``--quantize`` values (eval, generate, chat): one ``error:`` line, exit 2, before the model
is loaded; no traceback. And environment variables read as numbers or switches
(``LMLAB_NO_CPP_KERNELS``, ``OMP_NUM_THREADS``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmlab.errors import LmlabError
from lmlab.nn import quant_kernel
from lmlab.nn.quant import parse_spec
from tests.helpers import assert_one_error, run_cli


@pytest.mark.parametrize(
    "bad",
    [
        "int4:\u00b2",  # '²'.isdigit() is True but int() refuses it: was "unexpected ValueError"
        "int4:\u0663\u0662",  # Arabic-Indic 32: was accepted as 32
        "int4:",  # a colon and no group: was taken for the default
        "int4:1234567890",  # ten digits: no layer is that wide
        "int4: 32",
        "int8:+8",
    ],
)
def test_a_group_size_is_plain_ascii_digits(capsys, tiny_run, bad):
    with pytest.raises(LmlabError, match="must be int8 or int4"):
        parse_spec(bad)
    code, _, err = run_cli(capsys, "generate", tiny_run, "--quantize", bad, "--max-new-tokens", "1")
    assert_one_error(code, err, "must be int8 or int4", repr(bad))


def test_the_accepted_forms_still_parse():
    assert (parse_spec("int4:064").bits, parse_spec("int4:064").group_size) == (4, 64)
    assert parse_spec("int8").group_size is None and parse_spec("int4").group_size == 32


def test_an_int8_group_that_does_not_divide_suggests_cli_values(capsys, tiny_run):
    """It suggested "None (per row)", which is no --quantize value."""
    code, _, err = run_cli(
        capsys, "generate", tiny_run, "--quantize", "int8:3", "--max-new-tokens", "1"
    )
    line = assert_one_error(code, err, "group_size 3 does not divide", "32, 16, 8")
    assert "None" not in line and "int8 without :GROUP" in line


@pytest.mark.parametrize(
    ("value", "off"),
    [("1", True), ("yes", True), ("0", False), ("false", False), ("OFF", False), (" no ", False)],
)
def test_no_cpp_kernels_takes_false_for_false(monkeypatch, value, off):
    """LMLAB_NO_CPP_KERNELS=false switched the kernels off (anything but '' and '0' did)."""
    fake = SimpleNamespace(
        lmlab_kernels_avx512=lambda: 0, lmlab_kernels_avx2=lambda: 1, lmlab_kernels_vnni=lambda: 0
    )
    monkeypatch.setattr(quant_kernel, "_build", lambda: fake)  # no compiler run in the test
    monkeypatch.setenv(quant_kernel.ENV_OFF, value)
    quant_kernel._reset()
    try:
        with pytest.warns(RuntimeWarning) if off else _no_warning():
            quant_kernel._load()
        assert quant_kernel.status().startswith("disabled by") is off
    finally:
        quant_kernel._reset()


class _no_warning:
    def __enter__(self):
        import warnings

        self._c = warnings.catch_warnings()
        self._c.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._c.__exit__(*exc)


@pytest.mark.parametrize(
    ("value", "threads"), [("3", 3), ("\u00b2", None), ("0", None), ("x", None)]
)
def test_omp_num_threads_that_is_no_plain_number_falls_back(monkeypatch, value, threads):
    """A rank's thread count: OMP_NUM_THREADS="²" raised ValueError from int() under torchrun."""
    from lmlab.training.distributed import available_cores, threads_per_rank

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert threads_per_rank(1) == (threads or max(1, available_cores()))
