"""Expert daemons and their launcher (importable as moerun.daemons)."""
