"""The CPU expert kernels: each stored type's product against numpy on the dequantized weights, the grouped
expert FFN against the float32 reference, whole models' logits against the reference engine, and the build
(cache, notice without a compiler)."""
