"""moerun: run Mixture-of-Experts GGUF models across a heterogeneous rig."""
from pathlib import Path

from moerun import log as _log

# In a source checkout, `python -m moerun` run from its root imports this folder rather than the
# installed package; moerun.ipc and moerun.daemons then live beside it (ipc/, daemons/), where
# pyproject.toml maps them from.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").exists() and (_checkout / "ipc" / "__init__.py").exists():
    __path__.append(str(_checkout))

_log.install()
