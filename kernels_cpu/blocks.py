"""The GGUF tensor types the CPU kernels take, the float conversions they share, and the Q8_0
block quantizer that both the converter and the q8_0 KV cache use.

The block layouts themselves are decoded in block_ir.py (byte layouts: ggml's ggml-common.h).
"""
import numpy as np
from numba import njit

from gguf_io.quant_types import QUANT_TYPES

# Half-precision values by bit pattern, as ggml's table: 256 KiB, cache-resident (the converter's
# quantizers decode f16 scales with it).
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# every declared type (tests/test_structure.py: block_ir.DECODERS and rowdot_float.FLOAT_BYTES cover them)
SUPPORTED_TYPES = frozenset(QUANT_TYPES)


@njit(cache=True, inline="always")
def roundf(f):
    """C's roundf (halves away from zero) as int32."""
    t = np.trunc(f)
    if abs(f - t) >= np.float32(0.5):
        t += np.float32(1.0) if f > 0 else np.float32(-1.0)
    return np.int32(t)


@njit(cache=True, inline="always")
def quantize_q8_0(x, ints):
    """A Q8_0 block as llama.cpp's quantize_row_q8_0_ref makes it, in float32 step by step: x's
    32 values rounded into ints (any integer array: two's complement, as C's casts); returns the
    scale d = max|x| / 127, which the caller stores as float16 (x ~ d * ints)."""
    amax = np.float32(0.0)
    for v in x:
        amax = max(amax, abs(v))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    for j in range(x.shape[0]):
        ints[j] = roundf(x[j] * inv)
    return d
