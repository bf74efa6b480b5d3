"""Logits against Hugging Face transformers (the independent oracle), for every architecture and weight type."""
