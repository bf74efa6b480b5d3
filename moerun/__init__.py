"""moerun: run Mixture-of-Experts GGUF models across a heterogeneous rig."""
from moerun import log as _log

_log.install()
