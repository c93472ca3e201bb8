"""The GGUF tensor types the CPU kernels take, and the float conversions they share.

The block layouts themselves are decoded in block_ir.py (byte layouts: ggml's ggml-common.h).
"""
import numpy as np
from gguf import GGMLQuantizationType as T

from .block_ir import DECODERS

# Half-precision values by bit pattern, as ggml's table: 256 KiB, cache-resident (the converter's
# quantizers decode f16 scales with it).
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
SUPPORTED_TYPES = frozenset(DECODERS) | FLOAT_TYPES


def float_rows(qtype: T, raw: np.ndarray) -> np.ndarray:
    """F32 rows as a zero-copy view; F16 and BF16 rows converted to float32."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
