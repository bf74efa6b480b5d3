"""The expert daemon process's entry point (importable as moerun.daemons)."""
