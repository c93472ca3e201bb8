"""GGUF block layouts decoded in Triton, one function per layout, for the kernels of
triton_products.py.

A decoder takes `b`, (R, B, 1, 1) pointers to the first byte of B blocks in each of R rows, and
`ok`, their mask of the same shape. It returns (weights, inner): weights (R, B, P, L) float32,
and inner (P, L), each weight's place inside its block. The P × L grid is chosen per layout so that every weight's
bytes, bit shifts and scale are arithmetic on its grid position (no reshapes, which cost
register shuffles): a K-quant's P runs over its sub-blocks of 32, a legacy type's over its low
and high nibbles. Layouts follow ggml's block structs, as dequant.py's torch decoders do.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T

import triton
import triton.language as tl

from gguf_io.quant_types import IQ4_VALUES


@triton.jit
def _u8(pointers, ok):
    """Bytes as int32."""
    return tl.load(pointers, mask=ok, other=0).to(tl.int32)


@triton.jit
def _i8(pointers, ok):
    return tl.load(pointers.to(tl.pointer_type(tl.int8)), mask=ok, other=0).to(tl.int32)


@triton.jit
def _f16(pointers, ok):
    """Little-endian float16 (every one sits at an even offset of an even-sized block) as float32."""
    return tl.load(pointers.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _grid(P: tl.constexpr, L: tl.constexpr):
    return tl.arange(0, P)[:, None], tl.arange(0, L)[None, :]


@triton.jit
def q4_0(b, ok):  # d, qs[16]: weight l is qs[l]'s low nibble, weight 16 + l its high one
    h, l = _grid(2, 16)
    q = (_u8(b + 2 + l, ok) >> (4 * h)) & 0xF
    return _f16(b, ok) * (q - 8).to(tl.float32), 16 * h + l


@triton.jit
def q4_1(b, ok):  # d, m, qs[16]
    h, l = _grid(2, 16)
    q = (_u8(b + 4 + l, ok) >> (4 * h)) & 0xF
    return _f16(b, ok) * q.to(tl.float32) + _f16(b + 2, ok), 16 * h + l


@triton.jit
def _fifth_bit(qh, ok, e):
    """Q5_0/Q5_1: bit e of the little-endian 32-bit qh."""
    return (_u8(qh + (e >> 3), ok) >> (e & 7)) & 1


@triton.jit
def q5_0(b, ok):  # d, qh[4], qs[16]
    h, l = _grid(2, 16)
    q = ((_u8(b + 6 + l, ok) >> (4 * h)) & 0xF) | (_fifth_bit(b + 2, ok, 16 * h + l) << 4)
    return _f16(b, ok) * (q - 16).to(tl.float32), 16 * h + l


@triton.jit
def q5_1(b, ok):  # d, m, qh[4], qs[16]
    h, l = _grid(2, 16)
    q = ((_u8(b + 8 + l, ok) >> (4 * h)) & 0xF) | (_fifth_bit(b + 4, ok, 16 * h + l) << 4)
    return _f16(b, ok) * q.to(tl.float32) + _f16(b + 2, ok), 16 * h + l


@triton.jit
def q8_0(b, ok):  # d, qs[32] int8
    p, l = _grid(1, 32)
    return _f16(b, ok) * _i8(b + 2 + l, ok).to(tl.float32), 32 * p + l


@triton.jit
def mxfp4(b, ok):
    """E8M0 exponent e, qs[16] of 4-bit E2M1 codes (low nibbles first). Codes are doubled to
    integers (0, 1, 2, 3, 4, 6, 8, 12, signed) and the scale halved, as ggml does."""
    h, l = _grid(2, 16)
    code = (_u8(b + 1 + l, ok) >> (4 * h)) & 0xF
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    value = tl.where(code >= 8, -magnitude, magnitude).to(tl.float32)
    e = _u8(b, ok)
    half_scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half_scale * value, 16 * h + l


def _int64_of_bytes(values):
    """Eight signed bytes as one int64 (two's complement), value i in byte i."""
    word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))
    return word - (1 << 64) if word >= 1 << 63 else word


# IQ4_VALUES as the bytes of two words (values 0-7, 8-15): Triton has no constant tables.
_IQ4_LOW: tl.constexpr = tl.constexpr(_int64_of_bytes(IQ4_VALUES[:8]))
_IQ4_HIGH: tl.constexpr = tl.constexpr(_int64_of_bytes(IQ4_VALUES[8:]))


@triton.jit
def _iq4(code):
    """4-bit codes -> their IQ4_VALUES as float32: the code's byte of its word, sign-extended."""
    word = tl.where(code < 8, tl.full(code.shape, _IQ4_LOW, tl.int64), tl.full(code.shape, _IQ4_HIGH, tl.int64))
    byte = ((word >> (8 * (code & 7)).to(tl.int64)) & 0xFF).to(tl.int32)
    return (byte - ((byte & 0x80) << 1)).to(tl.float32)


@triton.jit
def iq4_nl(b, ok):  # d, qs[16]: Q4_0's nibbles, as codes of IQ4_VALUES
    h, l = _grid(2, 16)
    return _f16(b, ok) * _iq4((_u8(b + 2 + l, ok) >> (4 * h)) & 0xF), 16 * h + l


@triton.jit
def iq4_xs(b, ok):
    """d, scales_h (u16), scales_l[4], qs[128]. Sub-block j of 32 weights: IQ4_NL's nibbles at
    qs[16 j], under scale (nibble j % 2 of scales_l[j // 2] | bits 2j of scales_h << 4) - 32."""
    j, l = _grid(8, 32)
    code = (_u8(b + 8 + 16 * j + (l & 15), ok) >> (4 * (l >> 4))) & 0xF
    low = (_u8(b + 4 + (j >> 1), ok) >> (4 * (j & 1))) & 0xF
    high = (_u8(b + 2 + (j >> 2), ok) >> (2 * (j & 3))) & 3
    return _f16(b, ok) * ((low | (high << 4)) - 32).to(tl.float32) * _iq4(code), 32 * j + l


@triton.jit
def q2_k(b, ok):
    """scales[16] (scale | min << 4), qs[64], d, dmin. Runs t of 32 weights: qs[32 (t // 4) + l]
    shifted by 2 (t % 4); a scale per 16 weights."""
    t, l = _grid(8, 32)
    q = (_u8(b + 16 + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3
    sc = _u8(b + 2 * t + (l >> 4), ok)
    return (_f16(b + 80, ok) * ((sc & 0xF) * q).to(tl.float32)
            - _f16(b + 82, ok) * (sc >> 4).to(tl.float32)), 32 * t + l


@triton.jit
def q3_k(b, ok):
    """hmask[32], qs[64], scales[12] (16 six-bit values), d. Run t's weights take 2 bits as Q2_K's
    and subtract 4 where bit t of hmask[l] is clear."""
    t, l = _grid(8, 32)
    q = (_u8(b + 32 + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3
    q = q - 4 + 4 * ((_u8(b + l, ok) >> t) & 1)
    i = 2 * t + (l >> 4)  # scale i: low 4 bits in byte i % 8 (high nibble for i >= 8),
    low = (_u8(b + 96 + (i & 7), ok) >> (4 * (i >> 3))) & 0xF  # high 2 bits in byte 8 + i % 4
    high = (_u8(b + 104 + (i & 3), ok) >> (2 * (i >> 2))) & 3
    return _f16(b + 108, ok) * ((low | (high << 4)) - 32).to(tl.float32) * q.to(tl.float32), 32 * t + l


@triton.jit
def _k4_scale_min(scales, ok, j):
    """Q4_K/Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes."""
    a, c, e = _u8(scales + j, ok), _u8(scales + 4 + j, ok), _u8(scales + (j & 3), ok)
    first = j < 4
    sc = tl.where(first, a & 63, (c & 0xF) | ((e >> 6) << 4))
    m = tl.where(first, c & 63, (c >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def q4_k(b, ok):
    """d, dmin, scales[12], qs[128]. Sub-block j of 32 weights: nibble j % 2 of qs[32 (j // 2) + l]."""
    j, l = _grid(8, 32)
    q = (_u8(b + 16 + 32 * (j >> 1) + l, ok) >> (4 * (j & 1))) & 0xF
    sc, m = _k4_scale_min(b + 4, ok, j)
    return _f16(b, ok) * sc * q.to(tl.float32) - _f16(b + 2, ok) * m, 32 * j + l


@triton.jit
def q5_k(b, ok):
    """d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles, and bit j of qh[l] as the fifth bit."""
    j, l = _grid(8, 32)
    q = ((_u8(b + 48 + 32 * (j >> 1) + l, ok) >> (4 * (j & 1))) & 0xF) | (((_u8(b + 16 + l, ok) >> j) & 1) << 4)
    sc, m = _k4_scale_min(b + 4, ok, j)
    return _f16(b, ok) * sc * q.to(tl.float32) - _f16(b + 2, ok) * m, 32 * j + l


@triton.jit
def q6_k(b, ok):
    """ql[128], qh[64], scales[16] int8, d. Run t = 4 n + p of 32 weights (half n, quarter p):
    nibble p // 2 of ql[64 n + 32 (p % 2) + l], and bits 2p of qh[32 n + l] above it."""
    t, l = _grid(8, 32)
    low = (_u8(b + 64 * (t >> 2) + 32 * (t & 1) + l, ok) >> (4 * ((t >> 1) & 1))) & 0xF
    high = (_u8(b + 128 + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3
    sc = _i8(b + 192 + 2 * t + (l >> 4), ok)
    return _f16(b + 208, ok) * (sc * ((low | (high << 4)) - 32)).to(tl.float32), 32 * t + l


DECODERS = {T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0, T.Q5_1: q5_1, T.Q8_0: q8_0, T.MXFP4: mxfp4,
            T.Q2_K: q2_k, T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k,
            T.IQ4_NL: iq4_nl, T.IQ4_XS: iq4_xs}
