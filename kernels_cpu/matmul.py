"""Weight matrices kept as the file's raw blocks, and their products with activations.

A quantized matrix is a view of its rows in the memory-mapped file: nothing is unpacked or
copied at load. A few tokens (decode) go through rowdot.py, which reads every row once for all
of them. Many tokens (prefill) dequantize tiles of rows to float32 and hand them to BLAS, which
beats any hand loop once a tile is reused across tokens.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit, prange

from .blocks import FLOAT_TYPES, LAYOUTS, float_rows, unpack_row
from .rowdot import row_dot

PREFILL_TILE_ROWS = 512
# Up to this many tokens, reading each weight row once beats dequantizing tiles for BLAS.
FEW_TOKENS = 8


@njit(cache=True, parallel=True)
def _products(qtype, raw, x, xsum, out):
    """out = x @ W.T; row r is read once, while in L1, for every token."""
    for r in prange(raw.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = row_dot(qtype, raw, r, x, t, xsum)


@njit(cache=True, parallel=True)
def _dequantize_rows(qtype, raw, rows, group, out):
    """out[i] = row rows[i] of the matrix as float32."""
    k = out.shape[1]
    for i in prange(rows.shape[0]):
        q = np.empty(k, dtype=np.int8)
        scale = np.empty(k // group, dtype=np.float32)
        bias = np.zeros(k // group, dtype=np.float32)  # stays zero for the symmetric types
        unpack_row(qtype, raw[rows[i]], q, scale, bias)
        for g in range(k // group):
            for j in range(g * group, g * group + group):
                out[i, j] = scale[g] * np.float32(q[j]) + bias[g]


class QuantMatrix:
    """An (N, K) quantized weight matrix: its raw GGUF rows (N, bytes per row), used in place."""

    def __init__(self, qtype: GGMLQuantizationType, raw: np.ndarray, k: int):
        self.qtype, self.shape, self.raw = qtype, (raw.shape[0], k), raw
        _, self.group, self.has_bias = LAYOUTS[qtype]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x (T, K) float32 -> x @ W.T, (T, N)."""
        n, k = self.shape
        if x.ndim != 2 or x.shape[1] != k:  # the kernels read x[t, :k] unchecked
            raise ValueError(f"activations of shape {x.shape} for a matrix of {k} columns")
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], n), dtype=np.float32)
        if x.shape[0] <= FEW_TOKENS:
            xsum = (x.reshape(x.shape[0], -1, self.group).sum(axis=2) if self.has_bias
                    else np.empty((x.shape[0], 0), dtype=np.float32))
            _products(int(self.qtype), self.raw, x, xsum, out)
            return out
        tile = np.empty((min(PREFILL_TILE_ROWS, n), k), dtype=np.float32)
        for first in range(0, n, PREFILL_TILE_ROWS):
            rows = tile[:min(PREFILL_TILE_ROWS, n - first)]
            _dequantize_rows(int(self.qtype), self.raw, np.arange(first, first + len(rows)), self.group, rows)
            np.matmul(x, rows.T, out=out[:, first:first + rows.shape[0]])
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids outside 0..{self.shape[0] - 1}")
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        _dequantize_rows(int(self.qtype), self.raw, ids, self.group, out)
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
