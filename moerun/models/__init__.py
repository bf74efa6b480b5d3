"""Architecture specs: one small module per GGUF architecture."""
