"""The compiled kernels, shared by the tests of this package; the instruction set they run
with is reset to the best one after each test."""
from __future__ import annotations

import pytest

from moerun.backends.cpu.build import KernelsUnavailable, compiler
from moerun.backends.cpu.library import load_kernels


@pytest.fixture(scope="session")
def kernels():
    try:
        compiler()
    except KernelsUnavailable as err:
        pytest.skip(f"no C compiler on this machine: {err}")
    loaded = load_kernels()
    assert loaded is not None, "a machine with a C compiler must build the CPU kernels"
    return loaded


@pytest.fixture(autouse=True)
def best_instruction_set(request):
    yield
    if "kernels" in request.fixturenames:
        kernels = request.getfixturevalue("kernels")
        kernels.use_isa(kernels.isas()[0])
