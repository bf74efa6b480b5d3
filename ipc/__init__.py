"""Parent/daemon protocol and transports (importable as moerun.ipc)."""
