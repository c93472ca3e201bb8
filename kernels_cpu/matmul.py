"""Weight matrices in the unpacked form of blocks.py and their products with activations.

Decode (one or a few tokens) runs `_matmul_few`: per row, a 32-wide float accumulator takes
scale * q * x group by group, so the inner loop is a contiguous int8-to-float multiply-add with no
horizontal sum until the row ends. Prefill (many tokens) dequantizes tiles of rows to float32 and hands them to
BLAS, which is far faster than any hand loop once the tile is reused across tokens.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit, prange

from .blocks import FLOAT_TYPES, LAYOUTS, float_rows, unpack_row

PREFILL_TILE_ROWS = 512
# Up to this many tokens, reading each weight row once beats dequantizing tiles for BLAS.
FEW_TOKENS = 8


@njit(cache=True, parallel=True)
def _unpack_rows(qtype, raw, q, scale, bias):
    for r in prange(raw.shape[0]):
        unpack_row(qtype, raw[r], q[r], scale[r], bias[r])


@njit(cache=True, parallel=True, fastmath=True)
def _matmul_few(q, scale, bias, x, out):
    """out = x @ W.T for a few tokens x (T, K): each weight row is read once, while in L1, for all T."""
    n_rows, k = q.shape
    n_tokens = x.shape[0]
    n_groups = scale.shape[1]
    g = k // n_groups
    has_bias = bias.shape[1] > 0
    xsum = np.zeros((n_tokens, n_groups), dtype=np.float32)
    if has_bias:
        for t in range(n_tokens):
            for b in range(n_groups):
                for j in range(g):
                    xsum[t, b] += x[t, b * g + j]
    for r in prange(n_rows):
        qr = q[r]
        sr = scale[r]
        acc = np.empty(32, dtype=np.float32)
        for t in range(n_tokens):
            xt = x[t]
            acc[:] = 0.0
            for b in range(n_groups):
                s = sr[b]
                o = b * g
                for j in range(g):
                    acc[j] += s * (np.float32(qr[o + j]) * xt[o + j])
            y = acc.sum()
            if has_bias:
                br = bias[r]
                for b in range(n_groups):
                    y += br[b] * xsum[t, b]
            out[t, r] = y


@njit(cache=True, parallel=True, fastmath=True)
def _dequantize_rows(q, scale, bias, first, out):
    """out[i] = weights of row first + i, as float32."""
    n_groups = scale.shape[1]
    g = q.shape[1] // n_groups
    has_bias = bias.shape[1] > 0
    for i in prange(out.shape[0]):
        r = first + i
        for b in range(n_groups):
            s = scale[r, b]
            m = bias[r, b] if has_bias else np.float32(0.0)
            for j in range(b * g, b * g + g):
                out[i, j] = s * np.float32(q[r, j]) + m


class QuantMatrix:
    """An (N, K) quantized weight matrix, unpacked once at load from its raw GGUF rows."""

    def __init__(self, qtype: GGMLQuantizationType, raw: np.ndarray, k: int):
        _, group, has_bias = LAYOUTS[qtype]
        n = raw.shape[0]
        self.qtype, self.shape = qtype, (n, k)
        self.q = np.empty((n, k), dtype=np.int8)
        self.scale = np.empty((n, k // group), dtype=np.float32)
        self.bias = np.empty((n, k // group if has_bias else 0), dtype=np.float32)
        _unpack_rows(int(qtype), raw, self.q, self.scale, self.bias)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x (T, K) float32 -> x @ W.T, (T, N)."""
        n = self.shape[0]
        out = np.empty((x.shape[0], n), dtype=np.float32)
        if x.shape[0] <= FEW_TOKENS:
            _matmul_few(self.q, self.scale, self.bias, x, out)
            return out
        tile = np.empty((min(PREFILL_TILE_ROWS, n), self.shape[1]), dtype=np.float32)
        for first in range(0, n, PREFILL_TILE_ROWS):
            rows = tile[:min(PREFILL_TILE_ROWS, n - first)]
            _dequantize_rows(self.q, self.scale, self.bias, first, rows)
            np.matmul(x, rows.T, out=out[:, first:first + rows.shape[0]])
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        for i, r in enumerate(ids):
            _dequantize_rows(self.q, self.scale, self.bias, int(r), out[i:i + 1])
        return out


class FloatMatrix:
    """An (N, K) F32/F16/BF16 weight matrix held as float32 (F32 stays a view of the file)."""

    def __init__(self, qtype: GGMLQuantizationType, raw: np.ndarray, k: int):
        self.qtype, self.shape = qtype, (raw.shape[0], k)
        self.w = float_rows(qtype, raw).reshape(self.shape)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.T

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.w[ids].astype(np.float32)


def load_matrix(qtype: GGMLQuantizationType, raw: np.ndarray, k: int):
    """The matrix object for raw rows (N, bytes per row) of a tensor whose rows hold k weights."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if raw.ndim != 2 or k % block or raw.shape[1] != k // block * block_bytes:
        raise ValueError(f"{qtype.name} rows of {raw.shape[1]} bytes cannot hold {k} weights")
    return FloatMatrix(qtype, raw, k) if qtype in FLOAT_TYPES else QuantMatrix(qtype, raw, k)
