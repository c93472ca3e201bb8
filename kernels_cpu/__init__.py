"""Numba CPU kernels over quantized GGUF weights. Knows nothing of models."""
from .compile_cache import drop_stale_cache

drop_stale_cache()
