"""GGUF block layouts, unpacked at load into one SIMD-friendly form shared by every type.

Every quantized type stores a row as blocks of small integers with per-(sub)block scales and,
for the affine types, mins. At load each row becomes three contiguous arrays:

    q      int8 [K]          the integer of every weight
    scale  float32 [K / G]   per group of G weights (G = 32, or 16 for types with 16-wide sub-blocks)
    bias   float32 [K / G]   per-group offset (empty for the symmetric types)

so that weight[k] = scale[k // G] * q[k] + bias[k // G]. One product kernel serves all types, and
its inner loop runs over contiguous int8 (block-by-block decoding ran five times slower).
A new block type is one `_unpack_*` function here plus its entry in `LAYOUTS`.
Byte layouts follow ggml's ggml-common.h.
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


Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.Q8_0)

# type -> (weights per block, weights per scale group, has bias)
LAYOUTS = {
    T.Q4_0: (32, 32, False),
    T.Q4_1: (32, 32, True),
    T.Q5_0: (32, 32, False),
    T.Q5_1: (32, 32, True),
    T.Q8_0: (32, 32, False),
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


def float_rows(qtype: T, raw: np.ndarray) -> np.ndarray:
    """F32 rows as a zero-copy view; F16 and BF16 rows converted to float32."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
