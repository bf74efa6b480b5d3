"""GPU backend and GPU rigs (marked gpu; scripts/gpu_tests.sh runs them on a GPU machine), and the kernel
builds for AMD targets."""
