"""The numbers the GPU kernels (kernels/*.cu) and the Python that launches them must agree on,
defined here once. Every build of the kernel tree gets each as a `-D` define (`defines()`: the
backend's module, the compile tests); no kernel source defines them itself, and common.cuh
stops a build without them.

Shape legend: T tokens, H hidden, E experts, K experts per token.
"""
from __future__ import annotations

UNIT = 32               # weights per kernel work unit: a stored row holds a whole number of them
MAX_GEMV_TOKENS = 8          # most tokens one GEMV launch carries (decode and short steps)
MAX_EXPERTS = 1024      # most experts of a layer that routing and the prefill layout take (E)
MAX_TOP_K = 32          # most experts per token routing picks and the down kernel sums (K)
ROUTE_VALUES = 16       # hidden values each thread of route_normed holds: H <= ROUTE_VALUES x threads
NORM_VALUES = 8         # values of a row each rms_norm thread holds: rows of at most 8 x 1024
DAEMON_WORDS = 4        # words per daemon of a GPU ring's counters: request ids, failures, wait, compute
MAX_KEY_DIM = 128       # a DeltaNet key head's most values
MAX_CONV_WIDTH = 8      # a DeltaNet convolution's widest kernel
DELTA_COLUMNS = 32      # value columns one delta_rule block keeps ...
DELTA_GROUPS = 8        # ... by groups of state rows over a column
ATTENTION_THREADS = 256  # threads of a decode attention block: 8 groups of 32, one cache row each at a time

SHARED = ("UNIT", "MAX_GEMV_TOKENS", "MAX_EXPERTS", "MAX_TOP_K", "ROUTE_VALUES", "NORM_VALUES", "DAEMON_WORDS",
          "MAX_KEY_DIM", "MAX_CONV_WIDTH", "DELTA_COLUMNS", "DELTA_GROUPS", "ATTENTION_THREADS")


def defines() -> tuple[str, ...]:
    """The compiler options that give the kernels every shared number."""
    return tuple(f"-D{name}={globals()[name]}" for name in SHARED)
