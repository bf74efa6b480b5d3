"""The engine: the Runtime (loading, prefill and decode loops), the forward pass written once
over a backend, the weights, the sampler, the run telemetry."""
