"""Numba CPU kernels over quantized GGUF weights. Knows nothing of models."""
from .compile_cache import distinct_symbols, drop_stale_cache

distinct_symbols()
drop_stale_cache()
