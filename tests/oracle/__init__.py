"""Test oracle: tiny random Hugging Face MoE models, written to GGUF as llama.cpp's
converter would (to_gguf) and read back dequantized into transformers (from_gguf)."""
