"""One descriptor per weight type ggrun runs: its block (gguf's table), the 8-bit activation blocks
its fast dot product pairs with (llama.cpp's vec_dot_type), and the type llama.cpp falls back to
for rows that are not whole blocks of it. The implementations are tables keyed by these types, one
per backend and job (kernels_cpu's decoders, kernels_gpu's dequantizers, the converter's
quantizers); tests/test_structure.py checks that each covers every type declared here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T


@dataclass(frozen=True)
class QuantType:
    qtype: T
    activations: str                  # "q8_0" (blocks of 32), "q8_k" (super-blocks of 256) or "float" (kept)
    fallback: T | None = None         # for rows that are not a multiple of the block (llama-quant.cpp)

    @property
    def block(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def is_float(self) -> bool:
        return self.activations == "float"


QUANT_TYPES = {q.qtype: q for q in (
    QuantType(T.F32, "float"), QuantType(T.F16, "float"), QuantType(T.BF16, "float"),
    QuantType(T.Q4_0, "q8_0"), QuantType(T.Q4_1, "q8_0"), QuantType(T.Q5_0, "q8_0"), QuantType(T.Q5_1, "q8_0"),
    QuantType(T.Q8_0, "q8_0"), QuantType(T.MXFP4, "q8_0"),
    QuantType(T.Q2_K, "q8_k", fallback=T.Q4_0), QuantType(T.Q3_K, "q8_k", fallback=T.Q4_0),
    QuantType(T.Q4_K, "q8_k", fallback=T.Q5_0), QuantType(T.Q5_K, "q8_k", fallback=T.Q5_1),
    QuantType(T.Q6_K, "q8_k", fallback=T.Q8_0),
    QuantType(T.IQ4_NL, "q8_0"), QuantType(T.IQ4_XS, "q8_k", fallback=T.IQ4_NL),
    *(QuantType(t, "q8_k", fallback=T.IQ4_NL)
      for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)),
    QuantType(T.TQ1_0, "q8_k", fallback=T.Q4_0), QuantType(T.TQ2_0, "q8_k", fallback=T.Q4_0),
)}
# MXFP4's 4-bit codes (E2M1: a sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) as twice their values, which
# the block's E8M0 scale halves (ggml's kvalues_mxfp4; weight = value * 2^(e - 128))
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# IQ4_NL's and IQ4_XS's 4-bit codes: indices into these signed byte values (ggml's kvalues_iq4nl),
# which the block's scale multiplies
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FLOAT_TYPES = frozenset(t for t, q in QUANT_TYPES.items() if q.is_float)
BLOCK_TYPES = frozenset(QUANT_TYPES) - FLOAT_TYPES
# The i-quants whose groups of 8 (or 4) weights are indices into a grid of magnitudes (ggml-common.h)
GRID_TYPES = (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)


@cache
def grid(qtype: T) -> np.ndarray:
    """(entries, 8 or 4) int8: the values of each entry of an i-quant's grid (IQ2's magnitudes 8, 25,
    43; IQ3's; IQ1's -1, 0, 1), read once from gguf-py's packed copy of ggml's tables."""
    import gguf.quants
    kind = getattr(gguf.quants, qtype.name)
    kind.init_grid()
    return np.ascontiguousarray(kind.grid.reshape(kind.grid_shape).astype(np.int8))


def sign_byte(index: int) -> int:
    """ggml's ksigns_iq2xs: 7 sign bits and an eighth that makes their count even (the grids'
    eight signs have even parity, so the eighth is implied)."""
    return index | (bin(index).count("1") & 1) << 7
