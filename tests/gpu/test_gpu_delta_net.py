"""A gated DeltaNet layer's mixing on the GPU (its delta rule token by token) against the numpy
backend's (in chunks of up to 32 tokens from two tokens on), for steps of one token to a few
hundred, with the conv and recurrent states carried from one call into the next."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moerun.models.spec import DeltaNetShape
from tests.support.gpu import gpu_device, small_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_device() is None, reason="needs a GPU")]
BOUND = 1e-5                 # ‖gpu - numpy‖ / ‖numpy‖, f32 throughout on both sides


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def backends():
    from moerun.backends import open_backend
    from moerun.backends.numpy_backend import NumpyBackend
    shape = DeltaNetShape(key_heads=2, value_heads=4, key_dim=128, value_dim=96, conv_kernel=4)
    spec = dataclasses.replace(small_spec(), n_layers=1, moe_layers=(True,), recurrent_layers=(True,), delta_net=shape)
    return NumpyBackend(spec), open_backend(gpu_device(), spec)


def layer_inputs(shape: DeltaNetShape, n_tokens: int, rng) -> tuple:
    channels = rng.normal(size=(n_tokens, shape.channels)).astype(np.float32)
    z = rng.normal(size=(n_tokens, shape.value_heads * shape.value_dim)).astype(np.float32)
    beta = rng.normal(size=(n_tokens, shape.value_heads)).astype(np.float32)
    alpha = rng.normal(size=(n_tokens, shape.value_heads)).astype(np.float32)
    return channels, z, beta, alpha


@pytest.mark.parametrize("lengths", [(1, 7), (40,), (64,), (200, 77), (100, 1, 65)])
def test_the_delta_net_matches_numpy(backends, lengths):
    reference, gpu = backends
    shape, cupy = gpu.spec.delta_net, gpu.device.cupy
    rng = np.random.default_rng(sum(lengths))
    weights = (rng.normal(0, 0.3, (shape.channels, shape.conv_kernel)).astype(np.float32),
               -np.array([0.05, 1.0, 8.0, 30.0], np.float32),             # a = -exp(A_log): mild to steep decay
               rng.normal(0, 0.5, shape.value_heads).astype(np.float32),
               rng.normal(1, 0.1, shape.value_dim).astype(np.float32))
    want_cache, got_cache = reference.new_cache(1024), gpu.new_cache(1024)
    for n_tokens in lengths:
        inputs = layer_inputs(shape, n_tokens, rng)
        want = reference.delta_net(*inputs, weights, want_cache, 0)
        with gpu.device.stream:
            got = gpu.delta_net(*(cupy.asarray(x) for x in inputs), tuple(cupy.asarray(w) for w in weights),
                                got_cache, 0).get(stream=gpu.device.stream)
        assert relative_error(got, want) <= BOUND
    assert relative_error(got_cache.ssm[0].get(), want_cache.ssm[0]) <= BOUND
    assert relative_error(got_cache.conv[0].get(), want_cache.conv[0]) <= BOUND
