"""Compute backends: numpy (reference), CUDA and HIP."""
