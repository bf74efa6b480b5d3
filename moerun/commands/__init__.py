"""The `moerun` commands, one module each, and the options they share (options.py)."""
