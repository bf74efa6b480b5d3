"""CPU kernels for routed experts, straight from the quantized GGUF blocks: the C sources
(kernels/), their build at first use (build.py), the ctypes bindings (library.py) and the
experts over a mapped file (experts.py). docs/cpu.md has the design and the measurements."""
