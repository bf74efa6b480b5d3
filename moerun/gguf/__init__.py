"""GGUF files: mmap reader, quant formats, tokenizer."""
