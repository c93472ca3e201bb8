"""Numba CPU kernels over quantized GGUF weights. Knows nothing of models."""
