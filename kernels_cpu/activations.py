"""Activations rounded to integers once per product, for the dot products of rowdot.py
(16-bit, the precise path) and rowdot_int8.py (8-bit, the default).

The 8-bit formats are llama.cpp's `vec_dot_type`s, quantized exactly as its reference quantizers
do (quantize_row_q8_0_ref, quantize_row_q8_K_ref): Q8_0-style blocks of 32 for the 32-weight
types, Q8_K super-blocks of 256 for the K-quants. They are compiled without fast-math, which could
turn a division into a multiplication by a reciprocal and move a scale by one unit in the last
place; the max-abs loops use LLVM's maxnum, which is exact and still vectorizes.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES
from numba import njit, prange, types
from numba.extending import overload

from .intrinsics import f16_rounded, max_f32, min_f32, round_f32
from .rowdot import DX_BLOCK
from .type_sets import tagged_types

Q8_BLOCK, Q8_K_BLOCK, Q8_K_SUM = 32, 256, 16


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _abs_max(v):
    amax = np.float32(0.0)
    for j in range(v.shape[0]):
        amax = max_f32(amax, abs(v[j]))
    return amax


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _to_int16(v, inv, out):
    """out = round(v * inv), clamped to +-32767 (|v * inv| <= 32767 up to rounding)."""
    for j in range(v.shape[0]):
        out[j] = np.int16(max_f32(min_f32(round_f32(v[j] * inv), np.float32(32767.0)), np.float32(-32767.0)))


@njit(cache=True, fastmath=True, error_model="numpy")
def quantize_int16(x):
    """x (T, K) as 16-bit integers xq with a float32 scale dx per DX_BLOCK values (x ~ dx * xq,
    off by at most 1/65534 of the largest |x| among them), and the sums of each 16 values (exact,
    for the mins of affine types). 16 bits keep a product's error within 1e-5 of max|w| * sum|x|
    (the kernel tests' bound for the precise path), and let the integer units multiply 32 pairs
    at once. (The loops run over 1-d slices because LLVM vectorizes those, and not the same loops
    written with 2-d indexing.)"""
    n_tokens, k = x.shape
    n_scales = (k + DX_BLOCK - 1) // DX_BLOCK
    xq = np.empty((n_tokens, k), dtype=np.int16)
    dx = np.empty((n_tokens, n_scales), dtype=np.float32)
    xsum = np.empty((n_tokens, k // 16), dtype=np.float32)
    for t in range(n_tokens):
        for g in range(n_scales):
            first, last = g * DX_BLOCK, min(g * DX_BLOCK + DX_BLOCK, k)
            amax = _abs_max(x[t, first:last])
            dx[t, g] = amax / np.float32(32767.0)
            _to_int16(x[t, first:last], np.float32(32767.0) / amax if amax > 0 else np.float32(0.0),
                      xq[t, first:last])
        for g in range(k // 16):
            s = np.float32(0.0)
            for j in range(g * 16, g * 16 + 16):
                s += x[t, j]
            xsum[t, g] = s
    return xq, dx, xsum


@njit(cache=True, error_model="numpy", inline="always")
def _round_half_away(v):
    """C's roundf: to nearest, halves away from zero (v - trunc(v) is exact in floating point)."""
    whole = np.float32(np.trunc(v))
    rest = v - whole
    if rest >= np.float32(0.5):
        return whole + np.float32(1.0)
    if rest <= np.float32(-0.5):
        return whole - np.float32(1.0)
    return whole


@njit(cache=True, error_model="numpy")
def quantize_q8_0(x):
    """x (T, K), K a multiple of 32, as Q8_0 blocks: q (T, K) int8, d (T, K / 32) float32 (the
    block's float16 scale, widened), and each block's sum of q (T, K / 32) int32 and d times it
    (float32), which the offsets and mins of the weights' blocks multiply. x ~ d * q.

    As quantize_row_q8_0_ref: d = max|x| / 127 rounded to float16, q = roundf(x * (1 / d)) with d
    before that rounding."""
    n_tokens, k = x.shape
    n_blocks = k // Q8_BLOCK
    q = np.empty((n_tokens, k), dtype=np.int8)
    d = np.empty((n_tokens, n_blocks), dtype=np.float32)
    sums = np.empty((n_tokens, n_blocks), dtype=np.int32)
    scaled_sums = np.empty((n_tokens, n_blocks), dtype=np.float32)
    for t in range(n_tokens):
        for i in range(n_blocks):
            block = x[t, i * Q8_BLOCK:(i + 1) * Q8_BLOCK]
            scale = _abs_max(block) / np.float32(127.0)
            inverse = np.float32(1.0) / scale if scale != 0 else np.float32(0.0)
            total = 0
            for j in range(Q8_BLOCK):
                v = np.int8(_round_half_away(block[j] * inverse))
                q[t, i * Q8_BLOCK + j] = v
                total += v
            d[t, i] = f16_rounded(scale)
            sums[t, i] = total
            scaled_sums[t, i] = d[t, i] * np.float32(total)
    return q, d, sums, scaled_sums


_MAGNITUDE, _INFINITY = np.int32(0x7FFFFFFF), np.int32(0x7F800000)  # float32 bits


@njit(cache=True, error_model="numpy", inline="always")
def _largest(block):
    """The value of largest magnitude in a float32 block, the first of equal magnitudes, NaNs
    ignored (as quantize_row_q8_K_ref picks it). The bits of non-negative floats order as their
    values, so the largest magnitudes of the positive and the negative values are integer maxima,
    which vectorize where a chain of float comparisons does not; a block with NaNs, or with its
    largest magnitude both positive and negative, is searched in order instead."""
    bits = block.view(np.int32)
    positive, negative = np.int32(0), np.int32(0)
    for j in range(len(bits)):
        v = bits[j]
        positive = max(positive, v if v >= 0 else np.int32(0))
        negative = max(negative, (v & _MAGNITUDE) if v < 0 else np.int32(0))
    if positive != negative and max(positive, negative) <= _INFINITY:
        return np.int32(positive).view(np.float32) if positive > negative else -np.int32(negative).view(np.float32)
    amax, top = np.float32(0.0), np.float32(0.0)
    for j in range(len(block)):
        if abs(block[j]) > amax:
            amax, top = abs(block[j]), block[j]
    return top


@njit(cache=True, error_model="numpy")
def quantize_q8_k(x):
    """x (T, K), K a multiple of 256, as Q8_K super-blocks: q (T, K) int8, d (T, K / 256)
    float32 and the sums of q over each 16 (T, K / 16) int16, which the mins and offsets of the
    K-quants multiply. x ~ d * q.

    As quantize_row_q8_K_ref: the value of largest magnitude (the first of equals) maps to -127,
    q = nearest-even(x * -127 / that value), and d = 1 / (-127 / that value)."""
    n_tokens, k = x.shape
    n_blocks = k // Q8_K_BLOCK
    q = np.empty((n_tokens, k), dtype=np.int8)
    d = np.empty((n_tokens, n_blocks), dtype=np.float32)
    sums = np.empty((n_tokens, k // Q8_K_SUM), dtype=np.int16)
    for t in range(n_tokens):
        for i in range(n_blocks):
            first = i * Q8_K_BLOCK
            top = _largest(x[t, first:first + Q8_K_BLOCK])
            amax = abs(top)
            if amax == 0:
                q[t, first:first + Q8_K_BLOCK] = 0
                d[t, i] = 0
            else:
                scale = np.float32(-127.0) / top
                for j in range(first, first + Q8_K_BLOCK):
                    q[t, j] = np.int8(min(127.0, np.rint(scale * x[t, j])))
                d[t, i] = np.float32(1.0) / scale
            for g in range(Q8_K_BLOCK // Q8_K_SUM):
                total = 0
                for j in range(first + g * Q8_K_SUM, first + (g + 1) * Q8_K_SUM):
                    total += q[t, j]
                sums[t, i * (Q8_K_BLOCK // Q8_K_SUM) + g] = total
    return q, d, sums


# quantize_activations' `formats`: which of the two 8-bit formats a product's matrices pair with
Q8_0_ACTIVATIONS, Q8_K_ACTIVATIONS = 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _none_q8_0(x):
    """quantize_q8_0's arrays for no tokens (a product with no 32-weight types)."""
    n_blocks = x.shape[1] // Q8_BLOCK
    return (np.empty((0, x.shape[1]), np.int8), np.empty((0, n_blocks), np.float32), np.empty((0, n_blocks), np.int32),
            np.empty((0, n_blocks), np.float32))


@njit(cache=True, error_model="numpy", inline="always")
def _none_q8_k(x):
    """quantize_q8_k's arrays for no tokens (a product with no K-quants)."""
    return (np.empty((0, x.shape[1]), np.int8), np.empty((0, x.shape[1] // Q8_K_BLOCK), np.float32),
            np.empty((0, x.shape[1] // Q8_K_SUM), np.int16))


def rounding_kind(precise: bool) -> np.ndarray:
    """The `rounding` argument of the products: an empty array whose type says which activations
    to make (int16: the precise path, int8: llama.cpp's), so that only the kind used compiles."""
    return np.empty(0, dtype=np.int16 if precise else np.int8)


def quantize_activations(rounding, x, formats, kinds):
    """x rounded as `rounding` (rounding_kind) says: quantize_int16's tuple, or the 8-bit formats
    `formats` asks for as one tuple: quantize_q8_0's arrays, then quantize_q8_k's (those of a
    format not asked for hold no tokens). Only the formats of the types that kinds' dtype names
    (type_sets) compile."""


@overload(quantize_activations)
def _quantize_activations(rounding, x, formats, kinds):
    if rounding.dtype == types.int16:
        return lambda rounding, x, formats, kinds: quantize_int16(x)
    qtypes = tagged_types(kinds)
    blocks32 = any(GGML_QUANT_SIZES[t][0] == Q8_BLOCK for t in qtypes)
    k_quants = any(GGML_QUANT_SIZES[t][0] == Q8_K_BLOCK for t in qtypes)
    q8_0 = quantize_q8_0 if blocks32 else _none_q8_0
    q8_k = quantize_q8_k if k_quants else _none_q8_k

    def int8(rounding, x, formats, kinds):
        n_tokens = x.shape[0]
        q32, d32, sum32, ssum32 = q8_0(x[:n_tokens if formats & Q8_0_ACTIVATIONS else 0])
        q256, d256, sum16 = q8_k(x[:n_tokens if formats & Q8_K_ACTIVATIONS else 0])
        return q32, d32, sum32, ssum32, q256, d256, sum16
    return int8


@njit(cache=True, error_model="numpy")
def quantize_int8(x, formats, kinds):
    """quantize_activations' 8-bit tuple for x (quantize_int8_spans takes it span by span)."""
    return quantize_activations(np.empty(0, dtype=np.int8), x, formats, kinds)


@njit(cache=True, error_model="numpy", inline="always")
def _rows(part, n):
    """An array for n tokens of what part holds a span of (none where part holds no tokens)."""
    return np.empty((n if part.shape[0] else 0, part.shape[1]), dtype=part.dtype)


@njit(cache=True, error_model="numpy", inline="always")
def _put(out, part, first):
    if part.shape[0]:
        out[first:first + part.shape[0]] = part


@njit(cache=True, error_model="numpy", parallel=True)
def quantize_int8_spans(x, formats, kinds, span):
    """quantize_int8 on all threads, `span` tokens at a time (prefill's products: inside Numba's
    parallel region, whose threads are awake from the products before, where Python threads
    beside them waited on the cores)."""
    n = x.shape[0]
    first = quantize_int8(x[:span], formats, kinds)
    out = (_rows(first[0], n), _rows(first[1], n), _rows(first[2], n), _rows(first[3], n), _rows(first[4], n),
           _rows(first[5], n), _rows(first[6], n))
    for s in prange((n + span - 1) // span):
        part = first if s == 0 else quantize_int8(x[s * span:(s + 1) * span], formats, kinds)
        _put(out[0], part[0], s * span)
        _put(out[1], part[1], s * span)
        _put(out[2], part[2], s * span)
        _put(out[3], part[3], s * span)
        _put(out[4], part[4], s * span)
        _put(out[5], part[5], s * span)
        _put(out[6], part[6], s * span)
    return out
