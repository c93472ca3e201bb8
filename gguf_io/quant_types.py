"""One descriptor per weight type ggrun runs: its block (gguf's table), the 8-bit activation blocks
its fast dot product pairs with (llama.cpp's vec_dot_type), and the type llama.cpp falls back to
for rows that are not whole blocks of it. The implementations are tables keyed by these types, one
per backend and job (kernels_cpu's decoders, kernels_gpu's dequantizers, the converter's
quantizers); tests/test_structure.py checks that each covers every type declared here.
"""
from __future__ import annotations

from dataclasses import dataclass

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
)}
# MXFP4's 4-bit codes (E2M1: a sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) as twice their values, which
# the block's E8M0 scale halves (ggml's kvalues_mxfp4; weight = value * 2^(e - 128))
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# IQ4_NL's and IQ4_XS's 4-bit codes: indices into these signed byte values (ggml's kvalues_iq4nl),
# which the block's scale multiplies
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FLOAT_TYPES = frozenset(t for t, q in QUANT_TYPES.items() if q.is_float)
BLOCK_TYPES = frozenset(QUANT_TYPES) - FLOAT_TYPES
