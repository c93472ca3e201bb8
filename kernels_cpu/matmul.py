"""Weight matrices kept as the file's raw blocks, and their products with activations.

A quantized matrix is a view of its rows in the memory-mapped file: nothing is unpacked or
copied at load. A few tokens (decode) go through rowdot.py, which reads every row once for all
of them. Many tokens (prefill) go tile by tile of rows through AMX's tile units (amx.py) where the
CPU has them, else dequantize tiles to float32 for BLAS, which beats any hand loop once a tile is
reused across tokens.
"""
from __future__ import annotations

from functools import cached_property

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import carray, njit, prange

from . import amx
from .block_ir import MIN_OFFSET
from .blocks import FLOAT_TYPES, float_rows
from .intrinsics import max_f32, min_f32, pointer_at, round_f32
from .rowdot import DX_BLOCK, ROWS, row_dequantize, row_dot, rows_dot
from .threads import in_parallel

# Up to this many tokens, reading each weight row once beats dequantizing tiles for BLAS.
FEW_TOKENS = 8
# Rows are visited round-robin from this many far-apart places of the matrix, so that several
# memory streams are in flight at once: one sequential stream per thread read ~13 GB/s here,
# four ~20 GB/s.
STREAMS = 4


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
def _quantize_activations(x):
    """x (T, K) as 16-bit integers xq with a float32 scale dx per DX_BLOCK values (x ~ dx * xq,
    off by at most 1/65534 of the largest |x| among them), and the sums of each 16 values (exact,
    for the mins of affine types). 16 bits keep a product's error within 1e-5 of max|w| * sum|x|
    (the kernel tests' bound; 8-bit activations, as llama.cpp's, would not), and let the integer
    units multiply 32 pairs at once. (The loops over 1-d slices vectorize; written with 2-d
    indexing they did not, 3x slower.)"""
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


# A products table: one row per matrix, where its raw rows and (Q4_1, Q5_1) mins lie in memory.
# Addresses rather than arrays, so that one table serves any mix of matrices (a tuple of arrays
# would make every stack length a new compiled signature, and typing it cost microseconds per call).
MATRIX = np.dtype([("qtype", np.int64), ("raw", np.int64), ("rows", np.int64), ("row_bytes", np.int64),
                   ("mins", np.int64), ("min_cols", np.int64)])


@njit(cache=True, inline="always")
def matrix_arrays(mats, m):
    """Matrix m of a products table as arrays: raw rows (rows, bytes per row), mins (rows, min_cols)."""
    d = mats[m]
    return (carray(pointer_at(d.raw, np.uint8), (d.rows, d.row_bytes)),
            carray(pointer_at(d.mins, np.uint16), (d.rows, d.min_cols)))


@njit(cache=True, parallel=True)
def products(mats, tasks, single_rows, x, out):
    """out = x @ [W_0; W_1; ...].T for the matrices of a products table (MATRIX), stacked by rows.

    One parallel loop covers all the matrices that share an input (Q, K and V; gate and up).
    Task (m, row, col) is ROWS rows of matrix m from `row`, whose products go to out[:, col...];
    its rows are read once, while in L1, for every token. Rows of matrices shorter than ROWS are
    single_rows (m, row, col), done one by one after the loop (a branch for them inside it cost
    ~8%).
    """
    xq, dx, xsum = _quantize_activations(x)
    n_tasks = tasks.shape[0]
    stride = (n_tasks + STREAMS - 1) // STREAMS
    n_tokens = x.shape[0]
    for c in prange(stride):
        for s in range(STREAMS):
            j = s * stride + c
            if j >= n_tasks:
                break
            m = tasks[j, 0]
            raw, mins = matrix_arrays(mats, m)
            for t in range(n_tokens):
                rows_dot(mats[m].qtype, raw, mins, tasks[j, 1], xq, dx, t, xsum, out, tasks[j, 2])
    for j in range(single_rows.shape[0]):
        m = single_rows[j, 0]
        raw, mins = matrix_arrays(mats, m)
        for t in range(n_tokens):
            row_dot(mats[m].qtype, raw, mins, single_rows[j, 1], xq, dx, t, xsum, out, single_rows[j, 2])


@njit(cache=True, nogil=True)
def dequantize_rows(qtype, raw, rows, out):
    """out[i] = row rows[i] of the matrix as float32 (without the GIL: prefill runs it from
    several Python threads at once)."""
    for i in range(rows.shape[0]):
        row_dequantize(qtype, raw, rows[i], out, i)


class QuantMatrix:
    """An (N, K) quantized weight matrix: its raw GGUF rows (N, bytes per row), used in place."""

    def __init__(self, qtype: GGMLQuantizationType, raw: np.ndarray, k: int):
        # (rows of a file's tensor are contiguous already: no copy)
        self.qtype, self.shape, self.raw = qtype, (raw.shape[0], k), np.ascontiguousarray(raw)
        self.stacks = {}  # see stacked

    @cached_property
    def mins(self) -> np.ndarray:
        """The float16 mins of Q4_1/Q5_1 blocks as uint16 (rows, blocks per row), copied side by
        side for the dot products (a tenth of the matrix); (rows, 0) for other types. Made at the
        first product, so a prompt-only run never copies them."""
        at = MIN_OFFSET.get(self.qtype)
        if at is None:
            return np.zeros((self.shape[0], 0), dtype=np.uint16)
        block_bytes = GGML_QUANT_SIZES[self.qtype][1]
        blocks = self.raw.reshape(self.shape[0], -1, block_bytes)
        return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.uint16).reshape(self.shape[0], -1)

    @cached_property
    def descriptor(self) -> np.ndarray:
        """This matrix as a products table of one row (see MATRIX); valid while self lives."""
        raw, mins = self.raw, self.mins
        return np.array([(int(self.qtype), raw.ctypes.data, *raw.shape, mins.ctypes.data, mins.shape[1])],
                        dtype=MATRIX)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x (T, K) float32 -> x @ W.T, (T, N)."""
        if x.shape[0] <= FEW_TOKENS:
            return stacked([self]).products(x)
        return self.tiled_product(_ManyTokens(x, self.shape[1]))

    def tiled_product(self, x: _ManyTokens) -> np.ndarray:
        """x @ W.T for many tokens, tile by tile of rows on all threads: products on AMX where
        the CPU has it, else tiles of W dequantized to float32 for BLAS."""
        n, k = self.shape
        n_tokens = x.values.shape[0]
        out = np.empty((n_tokens, n), dtype=np.float32)

        def amx_tile(first, last):
            out[:, first:last] = amx.rows_product(int(self.qtype), self.raw, first, last, x.tiles)[:n_tokens]

        def blas_tile(first, last):
            w = np.empty((last - first, k), dtype=np.float32)
            dequantize_rows(int(self.qtype), self.raw, np.arange(first, last), w)
            np.matmul(x.values, w.T, out=out[:, first:last])
        in_parallel(blas_tile if x.tiles is None else amx_tile, n)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        check_row_ids(ids, self.shape[0])
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        dequantize_rows(int(self.qtype), self.raw, ids, out)
        return out


class _ManyTokens:
    """Activations of a prefill product, prepared once for every matrix that reads them."""

    def __init__(self, x: np.ndarray, k: int):
        self.values = _checked(x, k)

    @cached_property
    def tiles(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The activations packed for AMX (None without it), made at the first product."""
        return amx.activation_tiles(self.values) if amx.usable() else None


def check_row_ids(ids: np.ndarray, n_rows: int) -> None:
    """IndexError unless every id picks one of n_rows rows (the kernels read them unchecked)."""
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        raise IndexError(f"row ids outside 0..{n_rows - 1}")


def _checked(x: np.ndarray, k: int) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] != k:  # the kernels read x[t, :k] unchecked
        raise ValueError(f"activations of shape {x.shape} for a matrix of {k} columns")
    return np.ascontiguousarray(x, dtype=np.float32)


class _Stack:
    """Quantized matrices that take one input, prepared once for `products`."""

    def __init__(self, matrices):
        self.matrices = tuple(matrices)
        self.k = matrices[0].shape[1]
        if any(m.shape[1] != self.k for m in matrices):
            raise ValueError("matrices of one product must take inputs of the same size")
        self.mats = np.concatenate([m.descriptor for m in matrices])  # (self.matrices keeps them valid)
        ends = np.cumsum([m.shape[0] for m in matrices]).tolist()
        self.n, self.spans = ends[-1], list(zip([0] + ends[:-1], ends))
        self.tasks, self.single_rows = _tasks(matrices, [0] + ends[:-1])

    def products(self, x: np.ndarray) -> np.ndarray:
        """x @ [W_0; W_1; ...].T for a few tokens x (T, K)."""
        x = _checked(x, self.k)
        out = np.empty((x.shape[0], self.n), dtype=np.float32)
        products(self.mats, self.tasks, self.single_rows, x, out)
        return out


def _tasks(matrices, first_columns):
    """products' tasks: (matrix, first row, first output column) of ROWS rows each, the last
    one of a matrix overlapping its predecessor when ROWS does not divide the rows (they write the
    same values); and the rows of matrices shorter than ROWS, one by one. (numpy, not a Python
    loop per task: a vocabulary's output matrix alone has tens of thousands of tasks, and building
    them in Python cost the first decode step 0.03-0.04 s of a run's start-up.)"""
    tasks, single_rows = [], []
    for i, (m, col) in enumerate(zip(matrices, first_columns)):
        n = m.shape[0]
        rows = np.arange(n) if n < ROWS else np.minimum(np.arange(0, n, ROWS), n - ROWS)
        (single_rows if n < ROWS else tasks).append(np.stack([np.full_like(rows, i), rows, col + rows], axis=1))
    return tuple(np.concatenate(t).astype(np.int64) if t else np.empty((0, 3), np.int64)
                 for t in (tasks, single_rows))


def stacked(matrices) -> _Stack:
    """The stack of these matrices, kept on the first one (so it lives as long as the model)."""
    stacks = matrices[0].stacks
    key = tuple(map(id, matrices[1:]))
    found = stacks.get(key)
    if found is None or (key and any(a is not b for a, b in zip(found.matrices, matrices))):
        found = stacks[key] = _Stack(matrices)
    return found


def decode_stack(matrices: list, x: np.ndarray) -> _Stack | None:
    """The stack that runs x @ W.T for all these matrices in one decode-kernel call, if they are
    quantized and x is a few tokens; else None."""
    if x.shape[0] > FEW_TOKENS or not all(isinstance(m, QuantMatrix) for m in matrices):
        return None
    return stacked(matrices)


def matmuls(matrices: list, x: np.ndarray) -> list:
    """[x @ W.T for W in matrices], for matrices that take the same input.

    Quantized matrices and a few tokens share one kernel call; anything else goes one by one.
    """
    stack = decode_stack(matrices, x)
    if stack is None:
        if x.shape[0] <= FEW_TOKENS:
            return [m.matmul(x) for m in matrices]
        many = _ManyTokens(x, matrices[0].shape[1])
        return [m.tiled_product(many) if isinstance(m, QuantMatrix) else m.matmul(x) for m in matrices]
    out = stack.products(x)
    return [out[:, a:b] for a, b in stack.spans]


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
