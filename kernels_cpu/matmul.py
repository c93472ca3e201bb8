"""Weight matrices kept as the file's raw blocks, and their products with activations.

A matrix is a view of its rows in the memory-mapped file (quantized blocks, or F32/F16/BF16
values): nothing is unpacked or widened at load. A few tokens (decode) go through the row
kernels (rowdot*.py, interleaved.py), which read every row once for all of them. Many tokens
(prefill) go through the 8-bit products of interleaved groups, where the matrix has them: on
AMX's integer tiles where the CPU has them (amx_int8.py), else a few tokens per pass over each
group (interleaved.py); the types without interleaved groups (and IQ4_XS's groups, on VNNI)
decode eight rows at a time, then pass bands of 16 tokens over them (decoded_tiles.py); else
tile by tile of rows through AMX's tile units (amx.py) where the CPU has them (the precise path's
16-bit products); else they dequantize tiles to float32 for BLAS, which beats a hand loop of
16-bit products once a tile is reused across tokens.
"""
from __future__ import annotations

from functools import cached_property

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import carray, njit, prange
from numba.extending import overload

from gguf_io.quant_types import QUANT_TYPES

from . import amx, amx_int8
from .amx_int8 import groups_product_amx
from .block_ir import MIN_OFFSET
from .activations import (Q8_0_ACTIVATIONS, Q8_K_ACTIVATIONS, quantize_activations, quantize_int8_spans,
                          rounding_kind)
from .intrinsics import pointer_at
from .cpu_features import memory_streams
from .decoded_tiles import (BLOCK_BYTES, TOKENS, activation_bands, decode_group, decoded_band_product,
                            decodes_groups, decodes_in_tiles)
from .interleaved import GROUP, byte_places, groups_dot_int8, interleave, interleaves, row_blocks
from .type_sets import WeightTypes
from .rowdot import row_dequantize, rows_dot
from .rowdot_float import FLOAT_BYTES, row_float32, rows_dot_float
from .rowdot_int8 import rows_dot_int8
from .threads import in_parallel

# Up to this many tokens, reading each weight row once beats dequantizing tiles for BLAS.
FEW_TOKENS = 8
# Rows per task of the products' parallel loop. A task's rows are read one after the other, and
# consecutive tasks of a thread are consecutive rows, so each thread reads its share of the
# weights as one sequential stream (see cpu_features.memory_streams), which the hardware
# prefetchers follow. Each task also costs a call with fixed work (the type's dispatch, the
# activations' and output's views), so tasks are as large as the threads' balance allows: a
# stack too small to give each thread TASKS_PER_THREAD tasks of TASK_ROWS takes tasks of fewer
# rows, down to MIN_TASK_ROWS, and so does one whose threads would get unequal shares
# (task_rows).
TASK_ROWS, MIN_TASK_ROWS, TASKS_PER_THREAD = 64, 16, 4
# Prefill's 8-bit products: tasks of this many rows (their blocks stay in L2 while the tokens
# pass), tokens in blocks of this many (their activations stay in L2 while the rows pass).
PREFILL_TASK_ROWS, PREFILL_TOKEN_BLOCK = 64, 64


# A products table: one row per matrix, where its raw rows (or interleaved groups, with their
# interleaved.byte_places) and (Q4_1, Q5_1) mins lie in memory.
# Addresses rather than arrays, so that one table serves any mix of matrices (a tuple of arrays
# would make every stack length a new compiled signature, and typing it cost microseconds per call).
# Its dtype also names the weight types the table may hold (type_sets: each set compiles apart).
MATRIX = np.dtype([("qtype", np.int64), ("raw", np.int64), ("rows", np.int64), ("row_bytes", np.int64),
                   ("mins", np.int64), ("min_cols", np.int64), ("interleaved", np.int64), ("places", np.int64),
                   ("places_cols", np.int64)])


@njit(cache=True, inline="always")
def matrix_arrays(mats, m):
    """Matrix m of a products table as arrays: raw rows (rows, bytes per row), or its groups of
    interleaved rows where `interleaved` is set (interleaved.py); mins (rows, min_cols)."""
    d = mats[m]
    return (carray(pointer_at(d.raw, np.uint8), (d.rows, d.row_bytes)),
            carray(pointer_at(d.mins, np.uint16), (d.rows, d.min_cols)))


F32, F16, BF16 = (int(t) for t in FLOAT_BYTES)


@njit(cache=True, inline="always")
def is_float(qtype):
    return qtype == F32 or qtype == F16 or qtype == BF16


def rows_product(mats, m, w, mins, first, last, x, acts, out, col):
    """out[t, col + r - first] = row r of matrix m of the table mats (its rows w, mins) dotted
    with x[t], for rows first..last-1 and every token: float types' rows with x itself
    (rowdot_float.py), quantized ones with x's activations `acts` as quantize_activations made
    them: rowdot.py's kernel for the 16-bit ones, rowdot_int8.py's for the 8-bit ones, or
    interleaved.py's where the matrix is interleaved (only 8-bit activations: _Stack.products
    checks)."""


@overload(rows_product)
def _rows_product(mats, m, w, mins, first, last, x, acts, out, col):
    if len(acts) == 3:
        def precise(mats, m, w, mins, first, last, x, acts, out, col):
            if is_float(mats[m].qtype):
                rows_dot_float(mats, mats[m].qtype, w, first, last, x, out, col)
            else:
                rows_dot(mats, mats[m].qtype, w, mins, first, last, acts[0], acts[1], acts[2], out, col)
        return precise

    def int8(mats, m, w, mins, first, last, x, acts, out, col):
        if is_float(mats[m].qtype):
            rows_dot_float(mats, mats[m].qtype, w, first, last, x, out, col)
        elif mats[m].interleaved:
            groups_dot_int8(mats, mats[m].qtype, w, first, last, *acts, out, col)
        else:
            rows_dot_int8(mats, mats[m].qtype, w, first, last, *acts, out, col)
    return int8


@njit(cache=True, inline="always")
def streamed_task(c, s, stride, n_tasks):
    """The task a thread runs on its c-th visit of stream s, of n_tasks split into runs of
    `stride` (see products), or -1 past the last."""
    j = s * stride + c
    return j if j < n_tasks else -1


@njit(cache=True, parallel=True)
def products(mats, tasks, x, out, formats, rounding, streams):
    """out = x @ [W_0; W_1; ...].T for the matrices of a products table (MATRIX), stacked by rows,
    with the activations rounded as `rounding` (activations.rounding_kind) says, in the 8-bit
    `formats` the matrices pair with.

    One parallel loop covers all the matrices that share an input (Q, K and V; gate and up).
    Task (m, first, last, col) is rows first..last-1 of matrix m, whose products go to
    out[:, col...]; each row is read once, while in L1, for every token. The tasks are split into
    `streams` runs that each thread visits round-robin (cpu_features.memory_streams).
    """
    acts = quantize_activations(rounding, x, formats, mats)
    n_tasks = tasks.shape[0]
    stride = (n_tasks + streams - 1) // streams
    for c in prange(stride):
        for s in range(streams):
            j = streamed_task(c, s, stride, n_tasks)
            if j < 0:
                break
            m = tasks[j, 0]
            raw, mins = matrix_arrays(mats, m)
            rows_product(mats, m, raw, mins, tasks[j, 1], tasks[j, 2], x, acts, out, tasks[j, 3])


@njit(cache=True, parallel=True)
def many_products(mats, tasks, acts, out):
    """out = x @ W.T for many tokens and a matrix of interleaved groups (its products table
    mats), x in 8-bit activations acts (quantize_activations); tasks (m, first, last, col) as
    products' (of PREFILL_TASK_ROWS rows)."""
    q32, d32, sum32, ssum32, q256, d256, sum16 = acts
    for j in prange(tasks.shape[0]):
        m = tasks[j, 0]
        raw, _ = matrix_arrays(mats, m)
        for t in range(0, out.shape[0], PREFILL_TOKEN_BLOCK):
            u = t + PREFILL_TOKEN_BLOCK
            groups_dot_int8(mats, mats[m].qtype, raw, tasks[j, 1], tasks[j, 2], q32[t:u], d32[t:u], sum32[t:u],
                            ssum32[t:u], q256[t:u], d256[t:u], sum16[t:u], out[t:u], tasks[j, 3])


@njit(cache=True, parallel=True)
def many_products_amx(mats, tasks, acts, out, works):
    """many_products with AMX's integer tiles (amx_int8.py) for each task's pairs of groups and
    a multiple of 16 tokens, the vector path for the rest (a separate function: the tile
    instructions compile only for a CPU that has them); works: a row of amx_int8.work_bytes
    for each of Numba's threads."""
    q32, d32, sum32, ssum32, q256, d256, sum16 = acts
    k = max(q32.shape[1], q256.shape[1])
    tiled = out.shape[0] // amx_int8.TOKENS * amx_int8.TOKENS
    for j in prange(tasks.shape[0]):
        m, first, last, col = tasks[j, 0], tasks[j, 1], tasks[j, 2], tasks[j, 3]
        raw, _ = matrix_arrays(mats, m)
        paired = last - (last - first) % amx_int8.ROWS
        if tiled > 0 and paired > first:
            work = works[numba.get_thread_id()]
            groups_product_amx(mats, mats[m].qtype, raw, first, paired, q32[:tiled], d32[:tiled], sum32[:tiled],
                               ssum32[:tiled], q256[:tiled], d256[:tiled], sum16[:tiled], out[:tiled], col, work)
        for t in range(0, out.shape[0], PREFILL_TOKEN_BLOCK):
            u = min(t + PREFILL_TOKEN_BLOCK, out.shape[0])
            mid = min(max(t, tiled), u)  # tokens t..mid-1 went through the tiles
            if mid > t and paired < last:  # their rows that the pairs left
                groups_dot_int8(mats, mats[m].qtype, raw, paired, last, q32[t:mid], d32[t:mid], sum32[t:mid],
                                ssum32[t:mid], q256[t:mid], d256[t:mid], sum16[t:mid], out[t:mid],
                                col + paired - first)
            if u > mid:  # tokens past the tiles: every row
                groups_dot_int8(mats, mats[m].qtype, raw, first, last, q32[mid:u], d32[mid:u], sum32[mid:u],
                                ssum32[mid:u], q256[mid:u], d256[mid:u], sum16[mid:u], out[mid:u], col)


@njit(cache=True, parallel=True)
def many_decoded_products(mats, tasks, bq, bd, out, groups):
    """many_products for a matrix of rows of a type that prefill decodes in tiles
    (decoded_tiles.py): each group of rows of a task decoded once into this thread's scratch
    group (groups: one row for each of Numba's threads), then every band of tokens (bq, bd:
    activation_bands) passes over it."""
    for j in prange(tasks.shape[0]):
        m, first, last, col = tasks[j, 0], tasks[j, 1], tasks[j, 2], tasks[j, 3]
        raw, _ = matrix_arrays(mats, m)
        group = groups[numba.get_thread_id()]
        for r in range(first, last, GROUP):
            decode_group(mats, mats[m].qtype, raw, r, group)
            for band in range(bq.shape[0]):
                decoded_band_product(mats, mats[m].qtype, group, bq[band], bd[band], out, band * TOKENS,
                                     col + r - first)


@njit(cache=True, nogil=True)
def dequantize_rows(kinds, qtype, raw, rows, out):
    """out[i] = row rows[i] of the raw rows of a matrix of qtype as float32, for a qtype that
    kinds' dtype names (type_sets); without the GIL: prefill runs it from several Python threads
    at once."""
    for i in range(rows.shape[0]):
        if is_float(qtype):
            row_float32(kinds, qtype, raw, rows[i], out, i)
        else:
            row_dequantize(kinds, qtype, raw, rows[i], out, i)


@njit(cache=True, nogil=True)
def dequantize_matrix_rows(mats, m, rows, out):
    """dequantize_rows for matrix m of a products table, in either layout."""
    raw, _ = matrix_arrays(mats, m)
    if not mats[m].interleaved:
        dequantize_rows(mats, mats[m].qtype, raw, rows, out)
        return
    places = carray(pointer_at(mats[m].places, np.int64), (2, mats[m].places_cols))
    row = np.empty((1, raw.shape[1] // GROUP), dtype=np.uint8)
    for i in range(rows.shape[0]):
        row_blocks(raw, places, rows[i], row[0])
        row_dequantize(mats, mats[m].qtype, row, 0, out, i)


class WeightMatrix:
    """An (N, K) weight matrix of any type the kernels take: its raw GGUF rows (N, bytes per
    row), used in place, or (interleaved) a copy of them in interleaved groups (interleaved.py)
    for 8-bit products, where the type has them."""

    def __init__(self, qtype: GGMLQuantizationType, raw: np.ndarray, k: int, interleaved: bool = False,
                 types: WeightTypes | None = None, experts: int = 1):
        # types: the model's weight types, which its kernels compile for (this one's alone by default);
        # experts: a mixture's expert tensor, `experts` matrices of equal rows one after the other
        self.qtype, self.shape, self.types = qtype, (raw.shape[0], k), types or WeightTypes()
        self.types.add(qtype)
        self.experts = experts
        # (the 8-bit path's prefill decodes the rows of a type without interleaved groups in tiles)
        self.decoded_tiles = interleaved and decodes_in_tiles(qtype, raw.shape[0] // experts)
        if interleaved and interleaves(qtype, raw.shape[0] // experts):  # (groups within an expert)
            self.raw, self.groups, self.places = None, interleave(qtype, raw), byte_places(qtype)
        else:  # (rows of a file's tensor are contiguous already: no copy)
            self.raw, self.groups, self.places = np.ascontiguousarray(raw), None, np.zeros((2, 0), np.int64)
        self.stacks = {}  # see stacked

    def expert(self, e: int) -> WeightMatrix:
        """Expert e's rows, as a matrix of their own (a view: no copy)."""
        views = self.__dict__.setdefault("_experts", {})
        if e not in views:
            n = self.shape[0] // self.experts
            view = views[e] = object.__new__(WeightMatrix)
            view.qtype, view.shape, view.types, view.experts, view.stacks = self.qtype, (n, self.shape[1]), self.types, 1, {}
            view.decoded_tiles = self.decoded_tiles
            view.places, view.__dict__["mins"] = self.places, self.mins[e * n:(e + 1) * n]
            if self.groups is None:
                view.raw, view.groups = self.raw[e * n:(e + 1) * n], None
            else:
                view.raw, view.groups = None, self.groups[e * n // GROUP:(e + 1) * n // GROUP]
        return views[e]

    @property
    def reads_file(self) -> bool:
        """Whether the matrix reads the file's rows (else it holds a copy of its own)."""
        return self.groups is None

    @cached_property
    def as_rows(self) -> WeightMatrix:
        """This matrix with its rows as the file lays them out (self, or a copy read back out)."""
        return self if self.groups is None else WeightMatrix(self.qtype, self.row_blocks(0, self.shape[0]),
                                                             self.shape[1], types=self.types, experts=self.experts)

    def row_blocks(self, first: int, last: int) -> np.ndarray:
        """Rows first..last-1 as the file lays them out (a view, or read out of the groups)."""
        if self.groups is None:
            return self.raw[first:last]
        out = np.empty((last - first, self.groups.shape[1] // GROUP), dtype=np.uint8)
        for i in range(last - first):
            row_blocks(self.groups, self.places, first + i, out[i])
        return out

    @cached_property
    def mins(self) -> np.ndarray:
        """The float16 mins of Q4_1/Q5_1 blocks as uint16 (rows, blocks per row), copied side by
        side for the dot products (a tenth of the matrix); (rows, 0) for other types. Made at the
        first product, so a prompt-only run never copies them."""
        at, rows = MIN_OFFSET.get(self.qtype), self.shape[0]
        if at is None or self.raw is None:
            return np.zeros((rows, 0), dtype=np.uint16)
        block_bytes = GGML_QUANT_SIZES[self.qtype][1]
        blocks = self.raw.reshape(rows, -1, block_bytes)
        return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.uint16).reshape(rows, -1)

    @cached_property
    def descriptor(self) -> np.ndarray:
        """This matrix as a products table of one row (see MATRIX) naming its model's types;
        valid while self lives."""
        weights, mins = (self.raw, self.mins) if self.groups is None else (self.groups, self.mins)
        fields = (int(self.qtype), weights.ctypes.data, *weights.shape, mins.ctypes.data, mins.shape[1],
                  self.groups is not None, self.places.ctypes.data, self.places.shape[1], 0)
        return np.array([fields], dtype=self.types.dtype(MATRIX))

    def matmul(self, x: np.ndarray, precise: bool = False) -> np.ndarray:
        """x (T, K) float32 -> x @ W.T, (T, N); precise: decode's 16-bit activations."""
        if x.shape[0] <= FEW_TOKENS:
            return stacked([self]).products(x, precise)
        return self.tiled_product(_ManyTokens(x, self.shape[1]))

    def tiled_product(self, x: _ManyTokens) -> np.ndarray:
        """x @ W.T for many tokens, tile by tile of rows on all threads: 8-bit products of
        interleaved groups where the matrix has them (on AMX's integer tiles where the CPU has
        them; AMX's split bfloat16 products, whose 16 bits the precise path keeps, ran at half
        the vector path's speed) or of groups decoded from its rows (decoded_tiles) or, for
        decoded_tiles.GROUP_TYPES on VNNI without AMX, from its interleaved groups, else
        products on AMX where the CPU has it, else tiles of W dequantized to float32 for BLAS."""
        n, k = self.shape
        n_tokens = x.values.shape[0]
        out = np.empty((n_tokens, n), dtype=np.float32)
        if self.groups is not None or self.decoded_tiles:
            acts = x.int8(self.descriptor, _formats([self]))
            # (scratch kept per Python thread: fresh memory costs a page fault per 4 KiB)
            if self.decoded_tiles or (decodes_groups(self.qtype) and not amx_int8.usable()):
                groups = amx.scratch("decoded_groups", (numba.config.NUMBA_NUM_THREADS, BLOCK_BYTES * (k // 256)),
                                     np.uint8)
                many_decoded_products(self.descriptor, self.prefill_tasks, *x.bands(acts), out, groups)
            elif amx_int8.usable():
                works = amx.scratch("amx_int8", (numba.config.NUMBA_NUM_THREADS,
                                                 amx_int8.work_bytes(PREFILL_TASK_ROWS, k)), np.uint8)
                many_products_amx(self.descriptor, self.prefill_tasks, acts, out, works)
            else:
                many_products(self.descriptor, self.prefill_tasks, acts, out)
            return out

        def amx_tile(first, last):
            rows = self.row_blocks(first, last)
            out[:, first:last] = amx.rows_product(self.descriptor, int(self.qtype), rows, 0, last - first,
                                                  x.tiles)[:n_tokens]

        def blas_tile(first, last):
            w = np.empty((last - first, k), dtype=np.float32)
            dequantize_rows(self.descriptor, int(self.qtype), self.row_blocks(first, last), np.arange(last - first), w)
            np.matmul(x.values, w.T, out=out[:, first:last])
        in_parallel(blas_tile if self.qtype in FLOAT_BYTES or x.tiles is None else amx_tile, n)
        return out

    @cached_property
    def prefill_tasks(self) -> np.ndarray:
        return _tasks([self], [0], PREFILL_TASK_ROWS)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        check_row_ids(ids, self.shape[0])
        out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
        dequantize_matrix_rows(self.descriptor, 0, ids, out)
        return out


class _ManyTokens:
    """Activations of a prefill product, prepared once for every matrix that reads them."""

    def __init__(self, x: np.ndarray, k: int):
        self.values = _checked(x, k)
        self._int8 = {}  # 8-bit activations by format (see int8)
        self._bands = None  # their Q8_K part in bands (see bands)

    @cached_property
    def tiles(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The activations packed for AMX (None without it), made at the first product."""
        return amx.activation_tiles(self.values) if amx.usable() else None

    def int8(self, kinds: np.ndarray, formats: int) -> tuple:
        """The activations rounded to the 8-bit `formats` (quantize_activations's tuple), on all
        threads; made once for all the matrices that pair with the same formats."""
        found = self._int8.get(formats)
        if found is None:
            span = -(-len(self.values) // numba.get_num_threads())
            found = self._int8[formats] = quantize_int8_spans(self.values, formats, kinds, span)
        return found

    def bands(self, acts: tuple) -> tuple[np.ndarray, np.ndarray]:
        """The Q8_K activations of acts (int8's tuple) in decoded_tiles' bands, made once."""
        if self._bands is None:
            self._bands = activation_bands(acts[4], acts[5])
        return self._bands


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
        ends = np.cumsum([m.shape[0] for m in matrices]).tolist()
        self.n, self.spans = ends[-1], list(zip([0] + ends[:-1], ends))
        self.mats = _table(matrices)
        self.tasks = _tasks(matrices, [0] + ends[:-1], task_rows([m.shape[0] for m in matrices]))
        self.formats = _formats(matrices)

    def products(self, x: np.ndarray, precise: bool = False) -> np.ndarray:
        """x @ [W_0; W_1; ...].T for a few tokens x (T, K); precise: 16-bit activations (from
        the rows of interleaved matrices read back out: a backend that runs them loads the
        matrices as rows)."""
        x = _checked(x, self.k)
        if precise and any(m.groups is not None for m in self.matrices):
            return stacked([m.as_rows for m in self.matrices]).products(x, precise)
        out = np.empty((x.shape[0], self.n), dtype=np.float32)
        products(self.mats, self.tasks, x, out, self.formats, rounding_kind(precise), memory_streams())
        return out


def _table(matrices) -> np.ndarray:
    """The matrices' products table, naming all their types (the matrices keep it valid)."""
    rows = [m.descriptor for m in matrices]
    if len({row.dtype for row in rows}) > 1:  # matrices of different models (tests): name every type
        dtype = WeightTypes(m.qtype for m in matrices).dtype(MATRIX)
        rows = [row.astype(dtype) for row in rows]
    return np.concatenate(rows)


def _formats(matrices) -> int:
    """The 8-bit activation formats these matrices pair with (quantize_activations), as their
    types declare (gguf_io.quant_types: Q8_K for the K-quants, Q8_0 for the other quantized
    types, none for float types)."""
    paired = {QUANT_TYPES[m.qtype].activations for m in matrices}
    return (Q8_K_ACTIVATIONS if "q8_k" in paired else 0) | (Q8_0_ACTIVATIONS if "q8_0" in paired else 0)


def task_rows(row_counts: list) -> int:
    """Rows per task of a products stack of matrices of these row counts, on this thread count:
    at most TASK_ROWS, and at most what gives each thread TASKS_PER_THREAD tasks, down to
    MIN_TASK_ROWS; among those, the one whose busiest thread has the fewest rows (the parallel
    loop hands each thread an equal count of its iterations, and in a pass of several tokens, bound
    by arithmetic, a thread with one task more than the others keeps them waiting: SmolLM2's
    576-row matrices in tasks of 64 are 5 tasks against 4), the most rows on a tie. A multiple of
    MIN_TASK_ROWS, so that tasks hold whole groups of interleaved rows."""
    threads, streams = numba.get_num_threads(), memory_streams()
    fitting = sum(row_counts) // (TASKS_PER_THREAD * threads) // MIN_TASK_ROWS * MIN_TASK_ROWS

    def busiest(rows):
        iterations = -(-sum(-(-n // rows) for n in row_counts) // streams)  # (see products)
        return -(-iterations // threads) * streams * rows
    return min(range(max(MIN_TASK_ROWS, min(TASK_ROWS, fitting)), MIN_TASK_ROWS - 1, -MIN_TASK_ROWS), key=busiest)


def _tasks(matrices, first_columns, rows):
    """products' tasks: (matrix, first row, last row + 1, first output column) of up to `rows`
    rows each. (numpy, not a Python loop per task: a vocabulary's output matrix alone
    has thousands of tasks, and building them in Python would show in a run's start-up.)"""
    tasks = []
    for i, (m, col) in enumerate(zip(matrices, first_columns)):
        first = np.arange(0, m.shape[0], rows)
        tasks.append(np.stack([np.full_like(first, i), first, np.minimum(first + rows, m.shape[0]), col + first],
                              axis=1))
    return np.concatenate(tasks).astype(np.int64)


def stacked(matrices, kind=None):
    """The stack of these matrices (a _Stack, or `kind` of them), kept on the first one (so it
    lives as long as the model)."""
    kind = kind or _Stack
    stacks = matrices[0].stacks
    key = (kind, *map(id, matrices[1:]))
    found = stacks.get(key)
    if found is None or any(a is not b for a, b in zip(found.matrices[1:], matrices[1:])):
        found = stacks[key] = kind(matrices)
    return found


def decode_stack(matrices: list, x: np.ndarray) -> _Stack | None:
    """The stack that runs x @ W.T for all these matrices in one decode-kernel call, if x is a
    few tokens; else None."""
    if x.shape[0] > FEW_TOKENS:
        return None
    return stacked(matrices)


def matmuls(matrices: list, x: np.ndarray, precise: bool = False) -> list:
    """[x @ W.T for W in matrices], for matrices that take the same input.

    A few tokens' products share one kernel call; many tokens' go matrix by matrix, sharing
    their prepared activations. precise: a few tokens' products use 16-bit activations instead
    of 8-bit ones.
    """
    stack = decode_stack(matrices, x)
    if stack is None:
        many = _ManyTokens(x, matrices[0].shape[1])
        return [m.tiled_product(many) for m in matrices]
    out = stack.products(x, precise)
    return [out[:, a:b] for a, b in stack.spans]


def load_matrix(qtype: GGMLQuantizationType, raw: np.ndarray, k: int, interleaved: bool = False,
                types: WeightTypes | None = None, experts: int = 1):
    """The matrix for raw rows (N, bytes per row) of a tensor whose rows hold k weights;
    interleaved: in interleaved groups where the type has them, types: the model's, experts: the
    experts whose rows it stacks (see WeightMatrix)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if raw.ndim != 2 or k % block or raw.shape[1] != k // block * block_bytes:
        raise ValueError(f"{qtype.name} rows of {raw.shape[1]} bytes cannot hold {k} weights")
    if experts < 1 or raw.shape[0] % experts:
        raise ValueError(f"{raw.shape[0]} rows do not divide into {experts} experts")
    return WeightMatrix(qtype, raw, k, interleaved, types, experts)
