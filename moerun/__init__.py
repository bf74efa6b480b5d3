"""moerun: run Mixture-of-Experts GGUF models across a heterogeneous rig."""
