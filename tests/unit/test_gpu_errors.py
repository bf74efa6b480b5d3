"""A GPU failure ends a command in one `Error:` line that names the operation, never a traceback;
CuPy need not be installed for the CPU's commands to tell one."""
from __future__ import annotations

import click
from click.testing import CliRunner

from moerun.backends.devices import GpuError, is_gpu_error
from moerun.commands.options import friendly_errors


def cupy_error(message: str) -> Exception:
    """An exception of CuPy's driver module, as the device reports it at a synchronizing call."""
    kind = type("CUDADriverError", (RuntimeError,), {"__module__": "cupy_backends.cuda.api.driver"})
    return kind(message)


def command_raising(error: Exception) -> click.Command:
    @click.command()
    @friendly_errors
    def failing():
        raise error
    return failing


def test_a_device_error_from_a_later_call_is_one_error_line():
    result = CliRunner().invoke(command_raising(cupy_error("CUDA_ERROR_ILLEGAL_INSTRUCTION: an illegal "
                                                           "instruction was encountered")))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: the GPU failed in the model's forward pass: CUDA_ERROR_ILLEGAL_INSTRUCTION")
    assert "CUDA_LAUNCH_BLOCKING=1" in result.output and len(result.output.strip().splitlines()) == 1


def test_a_failed_launch_names_its_kernel():
    error = GpuError("kernel layout_pairs (grid (1,), block (1024,))", cupy_error("CUDA_ERROR_INVALID_VALUE"))
    result = CliRunner().invoke(command_raising(error))
    assert result.exit_code == 1
    assert result.output.startswith("Error: the GPU failed in kernel layout_pairs (grid (1,), block (1024,)): "
                                    "CUDA_ERROR_INVALID_VALUE")


def test_other_errors_are_not_taken_for_the_gpus():
    assert is_gpu_error(cupy_error("x")) and not is_gpu_error(RuntimeError("x"))
    result = CliRunner().invoke(command_raising(RuntimeError("a bug")))
    assert isinstance(result.exception, RuntimeError)          # a bug keeps its traceback
