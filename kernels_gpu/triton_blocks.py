"""GGUF block layouts decoded in Triton, one function per layout, for the kernels of
triton_products.py.

A decoder takes `b`, (R, B, 1, 1) pointers to the first byte of B blocks in each of R rows,
`ok`, their mask of the same shape, and `table`, the bytes of the type's grid (gguf_io's
quant_types.grid: the i-quants' rows of 8 or 4 values; unused by the other types). It returns
(weights, inner): weights (R, B, P, L) float32, and inner (P, L), each weight's place inside its
block. The P × L grid is chosen per layout so that every weight's
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
def q4_0(b, ok, table):  # d, qs[16]: weight l is qs[l]'s low nibble, weight 16 + l its high one
    h, l = _grid(2, 16)
    q = (_u8(b + 2 + l, ok) >> (4 * h)) & 0xF
    return _f16(b, ok) * (q - 8).to(tl.float32), 16 * h + l


@triton.jit
def q4_1(b, ok, table):  # d, m, qs[16]
    h, l = _grid(2, 16)
    q = (_u8(b + 4 + l, ok) >> (4 * h)) & 0xF
    return _f16(b, ok) * q.to(tl.float32) + _f16(b + 2, ok), 16 * h + l


@triton.jit
def _fifth_bit(qh, ok, e):
    """Q5_0/Q5_1: bit e of the little-endian 32-bit qh."""
    return (_u8(qh + (e >> 3), ok) >> (e & 7)) & 1


@triton.jit
def q5_0(b, ok, table):  # d, qh[4], qs[16]
    h, l = _grid(2, 16)
    q = ((_u8(b + 6 + l, ok) >> (4 * h)) & 0xF) | (_fifth_bit(b + 2, ok, 16 * h + l) << 4)
    return _f16(b, ok) * (q - 16).to(tl.float32), 16 * h + l


@triton.jit
def q5_1(b, ok, table):  # d, m, qh[4], qs[16]
    h, l = _grid(2, 16)
    q = ((_u8(b + 8 + l, ok) >> (4 * h)) & 0xF) | (_fifth_bit(b + 4, ok, 16 * h + l) << 4)
    return _f16(b, ok) * q.to(tl.float32) + _f16(b + 2, ok), 16 * h + l


@triton.jit
def q8_0(b, ok, table):  # d, qs[32] int8
    p, l = _grid(1, 32)
    return _f16(b, ok) * _i8(b + 2 + l, ok).to(tl.float32), 32 * p + l


@triton.jit
def mxfp4(b, ok, table):
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
def iq4_nl(b, ok, table):  # d, qs[16]: Q4_0's nibbles, as codes of IQ4_VALUES
    h, l = _grid(2, 16)
    return _f16(b, ok) * _iq4((_u8(b + 2 + l, ok) >> (4 * h)) & 0xF), 16 * h + l


@triton.jit
def iq4_xs(b, ok, table):
    """d, scales_h (u16), scales_l[4], qs[128]. Sub-block j of 32 weights: IQ4_NL's nibbles at
    qs[16 j], under scale (nibble j % 2 of scales_l[j // 2] | bits 2j of scales_h << 4) - 32."""
    j, l = _grid(8, 32)
    code = (_u8(b + 8 + 16 * j + (l & 15), ok) >> (4 * (l >> 4))) & 0xF
    low = (_u8(b + 4 + (j >> 1), ok) >> (4 * (j & 1))) & 0xF
    high = (_u8(b + 2 + (j >> 2), ok) >> (2 * (j & 3))) & 3
    return _f16(b, ok) * ((low | (high << 4)) - 32).to(tl.float32) * _iq4(code), 32 * j + l


@triton.jit
def q2_k(b, ok, table):
    """scales[16] (scale | min << 4), qs[64], d, dmin. Runs t of 32 weights: qs[32 (t // 4) + l]
    shifted by 2 (t % 4); a scale per 16 weights."""
    t, l = _grid(8, 32)
    q = (_u8(b + 16 + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3
    sc = _u8(b + 2 * t + (l >> 4), ok)
    return (_f16(b + 80, ok) * ((sc & 0xF) * q).to(tl.float32)
            - _f16(b + 82, ok) * (sc >> 4).to(tl.float32)), 32 * t + l


@triton.jit
def q3_k(b, ok, table):
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
def q4_k(b, ok, table):
    """d, dmin, scales[12], qs[128]. Sub-block j of 32 weights: nibble j % 2 of qs[32 (j // 2) + l]."""
    j, l = _grid(8, 32)
    q = (_u8(b + 16 + 32 * (j >> 1) + l, ok) >> (4 * (j & 1))) & 0xF
    sc, m = _k4_scale_min(b + 4, ok, j)
    return _f16(b, ok) * sc * q.to(tl.float32) - _f16(b + 2, ok) * m, 32 * j + l


@triton.jit
def q5_k(b, ok, table):
    """d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles, and bit j of qh[l] as the fifth bit."""
    j, l = _grid(8, 32)
    q = ((_u8(b + 48 + 32 * (j >> 1) + l, ok) >> (4 * (j & 1))) & 0xF) | (((_u8(b + 16 + l, ok) >> j) & 1) << 4)
    sc, m = _k4_scale_min(b + 4, ok, j)
    return _f16(b, ok) * sc * q.to(tl.float32) - _f16(b + 2, ok) * m, 32 * j + l


@triton.jit
def q6_k(b, ok, table):
    """ql[128], qh[64], scales[16] int8, d. Run t = 4 n + p of 32 weights (half n, quarter p):
    nibble p // 2 of ql[64 n + 32 (p % 2) + l], and bits 2p of qh[32 n + l] above it."""
    t, l = _grid(8, 32)
    low = (_u8(b + 64 * (t >> 2) + 32 * (t & 1) + l, ok) >> (4 * ((t >> 1) & 1))) & 0xF
    high = (_u8(b + 128 + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3
    sc = _i8(b + 192 + 2 * t + (l >> 4), ok)
    return _f16(b + 208, ok) * (sc * ((low | (high << 4)) - 32)).to(tl.float32), 32 * t + l


@triton.jit
def _parity_signs(field, e):
    """Whether weight e (0-7) of a chunk is negative by its 7-bit sign field, whose eighth bit makes
    the count of set bits even (ggml's ksigns_iq2xs)."""
    p = field ^ (field >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return ((field | ((p & 1) << 7)) >> e) & 1


@triton.jit
def _u32(at, ok):
    """A little-endian u32 as int64."""
    return (_u8(at, ok).to(tl.int64) | (_u8(at + 1, ok).to(tl.int64) << 8) | (_u8(at + 2, ok).to(tl.int64) << 16)
            | (_u8(at + 3, ok).to(tl.int64) << 24))


@triton.jit
def _signed(value, negative):
    return tl.where(negative != 0, -value, value)


@triton.jit
def _half_scale(d, s, step):
    """d * (0.5 + s) * step, the IQ2 and IQ3_XXS scales, in gguf.quants' float32 order."""
    return d * (0.5 + s.to(tl.float32)) * step


@triton.jit
def iq2_xxs(b, ok, table):
    """d, then per 32 weights j: four grid indices (a byte per 8) and a u32 of four 7-bit sign
    fields under a 4-bit scale s: weight = d * (0.5 + s) / 4 * grid * sign."""
    j, l = _grid(8, 32)
    c, e = l >> 3, l & 7
    group = b + 2 + 8 * j
    aux = _u32(group + 4, ok)
    values = _i8(table + 8 * _u8(group + c, ok) + e, ok).to(tl.float32)
    db = _half_scale(_f16(b, ok), (aux >> 28).to(tl.int32), 0.25)
    return _signed(db * values, _parity_signs(((aux >> (7 * c)) & 127).to(tl.int32), e)), 32 * j + l


@triton.jit
def iq2_xs(b, ok, table):
    """d, qs u16[32] (per 8 weights a 9-bit grid index under a 7-bit sign field), scales[8] (a
    nibble per 16 weights)."""
    j, l = _grid(8, 32)
    q = b + 2 + 2 * (4 * j + (l >> 3))
    entry = _u8(q, ok) | (_u8(q + 1, ok) << 8)
    values = _i8(table + 8 * (entry & 511) + (l & 7), ok).to(tl.float32)
    db = _half_scale(_f16(b, ok), (_u8(b + 66 + j, ok) >> (4 * (l >> 4))) & 0xF, 0.25)
    return _signed(db * values, _parity_signs(entry >> 9, l & 7)), 32 * j + l


@triton.jit
def iq2_s(b, ok, table):
    """d, qs[32] (grid index low bytes per 8 weights), signs[32] (a byte per 8), qh[8] (index
    bits 8-9 of entry q: bits 2 (q % 4) of qh[q // 4]), scales[8] (as IQ2_XS's)."""
    j, l = _grid(8, 32)
    q = 4 * j + (l >> 3)
    index = _u8(b + 2 + q, ok) | (((_u8(b + 66 + (q >> 2), ok) >> (2 * (q & 3))) & 3) << 8)
    values = _i8(table + 8 * index + (l & 7), ok).to(tl.float32)
    db = _half_scale(_f16(b, ok), (_u8(b + 74 + j, ok) >> (4 * (l >> 4))) & 0xF, 0.25)
    return _signed(db * values, (_u8(b + 34 + q, ok) >> (l & 7)) & 1), 32 * j + l


@triton.jit
def iq3_xxs(b, ok, table):
    """d, qs[64] (a grid index per 4 weights), then per 32 weights a u32 of four 7-bit sign fields
    under a 4-bit scale s: weight = d * (0.5 + s) / 2 * grid * sign."""
    j, l = _grid(8, 32)
    aux = _u32(b + 66 + 4 * j, ok)
    values = _i8(table + 4 * _u8(b + 2 + 8 * j + (l >> 2), ok) + (l & 3), ok).to(tl.float32)
    db = _half_scale(_f16(b, ok), (aux >> 28).to(tl.int32), 0.5)
    return _signed(db * values, _parity_signs(((aux >> (7 * (l >> 3))) & 127).to(tl.int32), l & 7)), 32 * j + l


@triton.jit
def iq3_s(b, ok, table):
    """d, qs[64] (grid index low bytes per 4 weights), qh[8] (bit 8 of entry 8j + i: bit i of
    qh[j]), signs[32] (a byte per 8 weights), scales[4] (a nibble s per 32): d * (1 + 2s)."""
    j, l = _grid(8, 32)
    index = _u8(b + 2 + 8 * j + (l >> 2), ok) | (((_u8(b + 66 + j, ok) >> (l >> 2)) & 1) << 8)
    values = _i8(table + 4 * index + (l & 3), ok).to(tl.float32)
    s = (_u8(b + 106 + (j >> 1), ok) >> (4 * (j & 1))) & 0xF
    db = _f16(b, ok) * (1 + 2 * s).to(tl.float32)
    return _signed(db * values, (_u8(b + 74 + 4 * j + (l >> 3), ok) >> (l & 7)) & 1), 32 * j + l


@triton.jit
def _iq1(dl, values, negative_delta):
    """dl * (grid + delta), delta -1/8 where negative_delta is set, else 1/8."""
    return dl * (values + tl.where(negative_delta != 0, -0.125, 0.125))


@triton.jit
def iq1_s(b, ok, table):
    """d, qs[32] (grid index low bytes per 8 weights), qh u16[8] per 32 weights: bits 3c .. 3c + 2
    index bits 8-10 of chunk c, bits 12-14 a scale s, bit 15 the sign of delta."""
    j, l = _grid(8, 32)
    c = l >> 3
    qh = _u8(b + 34 + 2 * j, ok) | (_u8(b + 35 + 2 * j, ok) << 8)
    index = _u8(b + 2 + 4 * j + c, ok) | (((qh >> (3 * c)) & 7) << 8)
    dl = _f16(b, ok) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    return _iq1(dl, _i8(table + 8 * index + (l & 7), ok).to(tl.float32), qh & 0x8000), 32 * j + l


@triton.jit
def iq1_m(b, ok, table):
    """qs[32] (grid index low bytes per 8 weights), qh[16] (a nibble per 8 weights, low first:
    index bits 8-10, the sign of delta), scales u16[4]: 3-bit scales per 16 weights in bits 0-11,
    the block's float16 d in their top nibbles (first word's lowest)."""
    j, l = _grid(8, 32)
    q = 4 * j + (l >> 3)
    code = (_u8(b + 32 + (q >> 1), ok) >> (4 * (q & 1))) & 0xF
    index = _u8(b + q, ok) | ((code & 7) << 8)
    d_bits = ((_u8(b + 49, ok) >> 4) | ((_u8(b + 51, ok) >> 4) << 4) | ((_u8(b + 53, ok) >> 4) << 8)
              | ((_u8(b + 55, ok) >> 4) << 12))
    d = d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    g = 2 * j + (l >> 4)  # (the scale of 16 weights: bits 3 (g % 4) of word g // 4)
    word = _u8(b + 48 + 2 * (g >> 2), ok) | (_u8(b + 49 + 2 * (g >> 2), ok) << 8)
    dl = d * (2 * ((word >> (3 * (g & 3))) & 7) + 1).to(tl.float32)
    return _iq1(dl, _i8(table + 8 * index + (l & 7), ok).to(tl.float32), code & 8), 32 * j + l


@triton.jit
def _trit(byte, power):
    """Digit of a TQ1_0 byte: (byte * power mod 256) * 3 >> 8, minus 1."""
    return ((((byte * power) & 255) * 3) >> 8) - 1


@triton.jit
def tq1_0(b, ok, table):
    """qs[48], qh[4], d: five base-3 digits per byte of qs (weight 32n + l from byte l < 32, then
    160 + 16n + m from byte 32 + m), four per byte of qh (240 + 4n + m from byte 48 + m)."""
    t, l = _grid(8, 32)
    at = 32 * t + l - 160  # (past the first 160 weights)
    tail = at < 80
    n = tl.where(t < 5, t, tl.where(tail, at >> 4, (at - 80) >> 2))
    byte_at = tl.where(t < 5, l, tl.where(tail, 32 + (at & 15), 48 + ((at - 80) & 3)))
    power = tl.where(n == 0, 1, tl.where(n == 1, 3, tl.where(n == 2, 9, tl.where(n == 3, 27, 81))))
    return _f16(b + 52, ok) * _trit(_u8(b + byte_at, ok), power).to(tl.float32), 32 * t + l


@triton.jit
def tq2_0(b, ok, table):
    """qs[64], d: weight 128h + 32j + l in bits 2j of byte 32h + l; weight = d * (value - 1)."""
    t, l = _grid(8, 32)
    q = ((_u8(b + 32 * (t >> 2) + l, ok) >> (2 * (t & 3))) & 3) - 1
    return _f16(b + 64, ok) * q.to(tl.float32), 32 * t + l


DECODERS = {T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0, T.Q5_1: q5_1, T.Q8_0: q8_0, T.MXFP4: mxfp4,
            T.Q2_K: q2_k, T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k,
            T.IQ4_NL: iq4_nl, T.IQ4_XS: iq4_xs, T.IQ1_S: iq1_s, T.IQ1_M: iq1_m, T.IQ2_XXS: iq2_xxs,
            T.IQ2_XS: iq2_xs, T.IQ2_S: iq2_s, T.IQ3_XXS: iq3_xxs, T.IQ3_S: iq3_s, T.TQ1_0: tq1_0, T.TQ2_0: tq2_0}
