"""CPU kernels for routed experts, straight from the quantized GGUF blocks: the C sources
(kernels/), their build at first use (build.py) and the ctypes bindings (library.py); the
experts over a mapped file are numpy_backend.QuantizedExperts. docs/cpu.md has the design and
the measurements."""
