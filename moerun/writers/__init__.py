"""Model writers: the synthetic qwen3moe files moerun makes for itself — the built-in demo model,
the benchmark models, the small models tests build."""
