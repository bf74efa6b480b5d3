"""The engine: forward pass, KV cache, sampler, generator."""
