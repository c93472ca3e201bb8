"""GGUF block layouts unpacked row by row, for dequantization (prefill tiles, embedding rows).

Every quantized type stores a row as blocks of small integers with per-(sub)block scales and,
for the affine types, mins. A row unpacks into three arrays:

    q      int8 [K]          the integer of every weight
    scale  float32 [K / G]   per group of G weights (G = 32, or 16 for types with 16-wide sub-blocks)
    bias   float32 [K / G]   per-group offset (left untouched for the symmetric types)

so that weight[k] = scale[k // G] * q[k] + bias[k // G]. Products with a few tokens do not come
here: rowdot.py reads the blocks directly. Byte layouts follow ggml's ggml-common.h.
"""
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

# Half-precision scales decode by table lookup, as ggml does: 256 KiB, cache-resident.
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, inline="always")
def _f16(raw, i):
    return F16_TABLE[np.int32(raw[i]) | (np.int32(raw[i + 1]) << 8)]


@njit(cache=True, inline="always")
def _u32(raw, i):
    return (np.uint32(raw[i]) | (np.uint32(raw[i + 1]) << 8)
            | (np.uint32(raw[i + 2]) << 16) | (np.uint32(raw[i + 3]) << 24))


# Each unpacker handles block `b` of one raw row: q[b*QK : (b+1)*QK], and the block's groups
# of scale/bias. Nibble blocks keep values j and j+16 in the low and high half of byte j.

@njit(cache=True, inline="always")
def _unpack_q4_0(raw, b, q, scale, bias):  # d:f16 qs[16]
    p = b * 18
    scale[b] = _f16(raw, p)
    for j in range(16):
        v = np.int32(raw[p + 2 + j])
        q[b * 32 + j] = (v & 15) - 8
        q[b * 32 + j + 16] = (v >> 4) - 8


@njit(cache=True, inline="always")
def _unpack_q4_1(raw, b, q, scale, bias):  # d:f16 m:f16 qs[16]
    p = b * 20
    scale[b] = _f16(raw, p)
    bias[b] = _f16(raw, p + 2)
    for j in range(16):
        v = np.int32(raw[p + 4 + j])
        q[b * 32 + j] = v & 15
        q[b * 32 + j + 16] = v >> 4


@njit(cache=True, inline="always")
def _unpack_q5(raw, p, qh_at, qs_at, offset, b, q):
    """Q5_0 and Q5_1 share this: bit j of the 32-bit qh is the fifth bit of value j."""
    qh = _u32(raw, p + qh_at)
    for j in range(16):
        v = np.int32(raw[p + qs_at + j])
        q[b * 32 + j] = ((v & 15) | (np.int32((qh >> j) & 1) << 4)) - offset
        q[b * 32 + j + 16] = ((v >> 4) | (np.int32((qh >> (j + 16)) & 1) << 4)) - offset


@njit(cache=True, inline="always")
def _unpack_q5_0(raw, b, q, scale, bias):  # d:f16 qh[4] qs[16]
    p = b * 22
    scale[b] = _f16(raw, p)
    _unpack_q5(raw, p, 2, 6, 16, b, q)


@njit(cache=True, inline="always")
def _unpack_q5_1(raw, b, q, scale, bias):  # d:f16 m:f16 qh[4] qs[16]
    p = b * 24
    scale[b] = _f16(raw, p)
    bias[b] = _f16(raw, p + 2)
    _unpack_q5(raw, p, 4, 8, 0, b, q)


@njit(cache=True, inline="always")
def _unpack_q8_0(raw, b, q, scale, bias):  # d:f16 qs[32] int8
    p = b * 34
    scale[b] = _f16(raw, p)
    for j in range(32):
        q[b * 32 + j] = np.int8(raw[p + 2 + j])


# K-quants: 256-weight super-blocks with one f16 scale (and min) refined per sub-block by
# small integer scales. Sub-blocks of 16 weights (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K) become
# the groups of the unpacked form.

@njit(cache=True, inline="always")
def _unpack_q2_k(raw, b, q, scale, bias):  # scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
    p = b * 84
    d = _f16(raw, p + 80)
    dmin = _f16(raw, p + 82)
    for g in range(16):
        sc = np.int32(raw[p + g])
        scale[b * 16 + g] = d * (sc & 15)
        bias[b * 16 + g] = -dmin * (sc >> 4)
    # 128-weight halves; in each, four 2-bit planes of the same 32 bytes, 16 + 16 weights per plane
    for half in range(2):
        for plane in range(4):
            for l in range(32):
                q[b * 256 + half * 128 + plane * 32 + l] = (np.int32(raw[p + 16 + half * 32 + l]) >> (2 * plane)) & 3


@njit(cache=True, inline="always")
def _unpack_q3_k(raw, b, q, scale, bias):  # hmask[32], qs[64], scales[12] (6-bit, packed), d
    p = b * 110
    d = _f16(raw, p + 108)
    for g in range(16):
        low = (np.int32(raw[p + 96 + g % 8]) >> (4 * (g // 8))) & 15
        high = (np.int32(raw[p + 104 + g % 4]) >> (2 * (g // 4))) & 3
        scale[b * 16 + g] = d * ((low | (high << 4)) - 32)
    for half in range(2):
        for plane in range(4):
            bit = half * 4 + plane  # the high-mask bit that cancels the -4 offset
            for l in range(32):
                v = (np.int32(raw[p + 32 + half * 32 + l]) >> (2 * plane)) & 3
                if not (np.int32(raw[p + l]) >> bit) & 1:
                    v -= 4
                q[b * 256 + half * 128 + plane * 32 + l] = v


@njit(cache=True, inline="always")
def _scale_min_k4(raw, p, j):
    """The j-th 6-bit (scale, min) pair of Q4_K/Q5_K's 12 packed scale bytes at raw[p]."""
    if j < 4:
        return np.int32(raw[p + j]) & 63, np.int32(raw[p + j + 4]) & 63
    sc = (np.int32(raw[p + j + 4]) & 15) | ((np.int32(raw[p + j - 4]) >> 6) << 4)
    mn = (np.int32(raw[p + j + 4]) >> 4) | ((np.int32(raw[p + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, inline="always")
def _unpack_k4_scales(raw, p, b, scale, bias):
    d = _f16(raw, p)
    dmin = _f16(raw, p + 2)
    for g in range(8):
        sc, mn = _scale_min_k4(raw, p + 4, g)
        scale[b * 8 + g] = d * sc
        bias[b * 8 + g] = -dmin * mn


@njit(cache=True, inline="always")
def _unpack_q4_k(raw, b, q, scale, bias):  # d, dmin, scales[12], qs[128]: 64 weights per 32 bytes
    p = b * 144
    _unpack_k4_scales(raw, p, b, scale, bias)
    for chunk in range(4):
        for l in range(32):
            v = np.int32(raw[p + 16 + chunk * 32 + l])
            q[b * 256 + chunk * 64 + l] = v & 15
            q[b * 256 + chunk * 64 + 32 + l] = v >> 4


@njit(cache=True, inline="always")
def _unpack_q5_k(raw, b, q, scale, bias):  # d, dmin, scales[12], qh[32], qs[128]
    p = b * 176
    _unpack_k4_scales(raw, p, b, scale, bias)
    for chunk in range(4):
        for l in range(32):
            v = np.int32(raw[p + 48 + chunk * 32 + l])
            h = np.int32(raw[p + 16 + l])
            q[b * 256 + chunk * 64 + l] = (v & 15) | (((h >> (2 * chunk)) & 1) << 4)
            q[b * 256 + chunk * 64 + 32 + l] = (v >> 4) | (((h >> (2 * chunk + 1)) & 1) << 4)


@njit(cache=True, inline="always")
def _unpack_q6_k(raw, b, q, scale, bias):  # ql[128], qh[64], scales[16] int8, d
    p = b * 210
    d = _f16(raw, p + 208)
    for g in range(16):
        scale[b * 16 + g] = d * np.int8(raw[p + 192 + g])
    for half in range(2):
        for l in range(32):
            lo0 = np.int32(raw[p + half * 64 + l])
            lo1 = np.int32(raw[p + half * 64 + 32 + l])
            h = np.int32(raw[p + 128 + half * 32 + l])
            o = b * 256 + half * 128 + l
            q[o] = ((lo0 & 15) | ((h & 3) << 4)) - 32
            q[o + 32] = ((lo1 & 15) | (((h >> 2) & 3) << 4)) - 32
            q[o + 64] = ((lo0 >> 4) | (((h >> 4) & 3) << 4)) - 32
            q[o + 96] = ((lo1 >> 4) | (((h >> 6) & 3) << 4)) - 32


Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.Q8_0)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(T.Q2_K), int(T.Q3_K), int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)

# type -> (weights per block, weights per scale group, has bias)
LAYOUTS = {
    T.Q4_0: (32, 32, False),
    T.Q4_1: (32, 32, True),
    T.Q5_0: (32, 32, False),
    T.Q5_1: (32, 32, True),
    T.Q8_0: (32, 32, False),
    T.Q2_K: (256, 16, True),
    T.Q3_K: (256, 16, False),
    T.Q4_K: (256, 32, True),
    T.Q5_K: (256, 32, True),
    T.Q6_K: (256, 16, False),
}
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
SUPPORTED_TYPES = frozenset(LAYOUTS) | FLOAT_TYPES


@njit(cache=True)
def unpack_row(qtype, raw, q, scale, bias):
    """Unpack one raw row into q (int8, K), scale and bias (float32, K / G each)."""
    if qtype == Q4_0:
        for b in range(q.size // 32):
            _unpack_q4_0(raw, b, q, scale, bias)
    elif qtype == Q4_1:
        for b in range(q.size // 32):
            _unpack_q4_1(raw, b, q, scale, bias)
    elif qtype == Q5_0:
        for b in range(q.size // 32):
            _unpack_q5_0(raw, b, q, scale, bias)
    elif qtype == Q5_1:
        for b in range(q.size // 32):
            _unpack_q5_1(raw, b, q, scale, bias)
    elif qtype == Q8_0:
        for b in range(q.size // 32):
            _unpack_q8_0(raw, b, q, scale, bias)
    elif qtype == Q2_K:
        for b in range(q.size // 256):
            _unpack_q2_k(raw, b, q, scale, bias)
    elif qtype == Q3_K:
        for b in range(q.size // 256):
            _unpack_q3_k(raw, b, q, scale, bias)
    elif qtype == Q4_K:
        for b in range(q.size // 256):
            _unpack_q4_k(raw, b, q, scale, bias)
    elif qtype == Q5_K:
        for b in range(q.size // 256):
            _unpack_q5_k(raw, b, q, scale, bias)
    elif qtype == Q6_K:
        for b in range(q.size // 256):
            _unpack_q6_k(raw, b, q, scale, bias)


def float_rows(qtype: T, raw: np.ndarray) -> np.ndarray:
    """F32 rows as a zero-copy view; F16 and BF16 rows converted to float32."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
