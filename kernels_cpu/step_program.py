"""Decode steps recorded once and replayed as one compiled call (the CPU's CUDA graphs).

A decode step of a small model is some 300 kernel calls. Called one by one from Python, the
interpreter, argument typing and per-call set-up cost more than a tenth of the step. So the
first one-token step over a cache runs eagerly while a Recorder writes down each backend
operation: which kernel, on which memory. Later steps replay that program inside one Numba
function; the host only passes the step's inputs (token id, position, slots, the positions the
slots hold).

A program is a table of integer rows, one per operation, naming memory by address: the
activations the recording step allocated (kept alive by the program and rewritten by every
replay), the model's weights and the cache's arrays. Model code also computes with numpy
operators (residual sums, biases, scales); during the recording its arrays are `_Traced`, which
records those too. Whatever the recorder cannot express (an untraced temporary, a float weight
matrix, an unknown numpy function) marks the step not replayable, and it runs eagerly as before.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from . import ops
from .attention import attention_few
from .intrinsics import pointer_at, rows_tag
from .kv_layout import as_kernel_array, head_dims, store_kv
from .activations import rounding_kind
from .cpu_features import memory_streams
from .type_sets import tagged_dtype
from .matmul import MATRIX, check_row_ids, dequantize_matrix_rows, products

# Operation codes; each row of a program is (code, arguments...) as the comments list them.
EMBED = 1       # matrix, ids input, out, width: out[t] = row ids[t] of the matrix
SCALE = 2       # x, out, n; factor: out = x * factor
ADD = 3         # a, b, out, n: out = a + b
RMS_NORM = 4    # x, weight, out, rows, width; eps
PRODUCTS = 5    # x, out, tokens, k, n, tasks first, last, formats
ROPE_TABLE = 6  # positions input, frequencies, n, cos, sin; position scale
ROPE = 7        # x, tokens, heads, dim, cos, sin, n, neox
STORE_KV = 8    # cache, slots input, k, v, tokens, key dim, value dim
ATTENTION = 9   # q, tokens, heads, cache, query positions input, key positions input, out, window, key dim,
                # value dim; scale, softcap
SILU_MUL = 10   # gate, up, rows, width
GELU_MUL = 11   # gate, up, rows, width
SOFTCAP = 12    # x, out, n; cap
ARGS = 10
# columns of a program's cache table: keys (kv heads, tiles, dim, tile) and values (kv heads, slots, dim)
CACHE_COLUMNS = 8


class NotReplayable(Exception):
    """The step does something the program cannot express."""


@njit(cache=True, inline="always")
def _f32(address, shape):
    return carray(pointer_at(address, np.float32), shape)


@njit(cache=True, inline="always")
def _input(inputs, i, dtype):
    return carray(pointer_at(inputs[i, 0], dtype), (inputs[i, 1],))


@njit(cache=True)
def run_program(code, params, mats, tasks, caches, inputs, kv_like, rounding, streams, group_tag):
    """One replay of a recorded step; kv_like (empty) has the cache's element type, rounding
    (activations.rounding_kind) says how the products round activations, streams how they read
    the weights (cpu_features.memory_streams), group_tag the queries per KV head of attention
    (intrinsics.rows_tag)."""
    for i in range(code.shape[0]):
        op, a, f = code[i, 0], code[i, 1:], params[i]
        if op == EMBED:
            ids = _input(inputs, a[1], np.int64)
            dequantize_matrix_rows(mats, a[0], ids, _f32(a[2], (ids.shape[0], a[3])))
        elif op == SCALE:
            x, out, factor = _f32(a[0], (a[2],)), _f32(a[1], (a[2],)), np.float32(f[0])
            for j in range(a[2]):
                out[j] = x[j] * factor
        elif op == ADD:
            x, y, out = _f32(a[0], (a[3],)), _f32(a[1], (a[3],)), _f32(a[2], (a[3],))
            for j in range(a[3]):
                out[j] = x[j] + y[j]
        elif op == RMS_NORM:
            ops.rms_norm(_f32(a[0], (a[3], a[4])), _f32(a[1], (a[4],)), np.float32(f[0]), _f32(a[2], (a[3], a[4])))
        elif op == PRODUCTS:
            products(mats, tasks[a[5]:a[6]], _f32(a[0], (a[2], a[3])), _f32(a[1], (a[2], a[4])), a[7], rounding,
                     streams)
        elif op == ROPE_TABLE:
            positions = _input(inputs, a[0], np.int32)
            shape = (positions.shape[0], a[2])
            ops.rope_angles(positions, carray(pointer_at(a[1], np.float64), (a[2],)), f[0], _f32(a[3], shape),
                            _f32(a[4], shape))
        elif op == ROPE:
            shape = (a[1], a[6])
            ops.rope(_f32(a[0], (a[1], a[2], a[3])), _f32(a[4], shape), _f32(a[5], shape), a[7] != 0)
        elif op == STORE_KV:
            keys, values = _cache(caches, a[0], kv_like)
            n_kv = keys.shape[0]
            store_kv(keys, values, _input(inputs, a[1], np.int64), _f32(a[2], (a[4], n_kv, a[5])),
                     _f32(a[3], (a[4], n_kv, a[6])))
        elif op == ATTENTION:
            keys, values = _cache(caches, a[3], kv_like)
            attention_few(_f32(a[0], (a[1], a[2], a[8])), keys, values, _input(inputs, a[4], np.int32),
                          _input(inputs, a[5], np.int32), np.float32(f[0]), a[7], np.float32(f[1]),
                          _f32(a[6], (a[1], a[2], a[9])), group_tag)
        elif op == SILU_MUL:
            ops.silu_mul(_f32(a[0], (a[2], a[3])), _f32(a[1], (a[2], a[3])))
        elif op == GELU_MUL:
            ops.gelu_mul(_f32(a[0], (a[2], a[3])), _f32(a[1], (a[2], a[3])))
        elif op == SOFTCAP:
            ops.softcap(_f32(a[0], (a[2],)), np.float32(f[0]), _f32(a[1], (a[2],)))


@njit(cache=True, inline="always")
def _cache(caches, c, kv_like):
    row = caches[c]
    keys = carray(pointer_at(row[0], kv_like.dtype), (row[1], row[2], row[3], row[4]))
    return keys, carray(pointer_at(row[5], kv_like.dtype), (row[1], row[6], row[7]))


class _Traced(np.ndarray):
    """An activation of the recording step: numpy arithmetic on it is recorded as well."""

    def __array_finalize__(self, obj):
        self.recorder = getattr(obj, "recorder", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [np.asarray(x) if isinstance(x, np.ndarray) else x for x in inputs]
        result = getattr(ufunc, method)(*plain, **kwargs)
        if self.recorder is None:
            return result
        return self.recorder.ufunc(ufunc, method, plain, kwargs, result)


class Recorder:
    """Writes down a step's operations while the backend runs them eagerly (see module doc)."""

    def __init__(self, batch, constants, precise):
        self.precise = precise      # how the products round activations (the backend's choice)
        self.rows: list = []
        self.failed: str | None = None
        self.constants = constants  # id -> the weight vectors the backend loaded
        self.keep: dict = {}        # id -> every array the program reads or writes by address
        self.produced: set = set()  # ids of the step's own activations
        self.inputs: list = []      # (batch field, index in the field's tuple or None, dtype)
        self._input_ids: dict = {}
        for name, value in batch.named_arrays():
            for j, array in enumerate(value) if isinstance(value, tuple) else [(None, value)]:
                self._input_ids[id(array)] = len(self.inputs)
                self.inputs.append((name, j, array.dtype))
        self.mats: list = []        # products-table rows
        self.embedding_rows: list = []  # the row count of each embedding matrix (token ids must be below)
        self._mat_ids: dict = {}
        self.tasks = [np.zeros((0, 4), np.int64)]
        self.n_tasks = 0
        self.caches: list = []
        self._cache_ids: dict = {}
        self.rope_tables: dict = {}
        self.kv_dtype = None
        self.group = None           # queries per KV head, the same in every layer

    # --- operands
    def fail(self, why: str):
        if self.failed is None:
            self.failed = why

    def traced(self, array):
        """A new activation of the step, returned to the model as a _Traced view."""
        root = _root(array)
        if root.dtype != np.float32 or not root.flags.c_contiguous:
            self.fail("an activation that is not contiguous float32")
        self.produced.add(id(root))
        self.keep[id(root)] = root
        view = array.view(_Traced)
        view.recorder = self
        return view

    def address(self, array, size: int) -> int:
        """Where a float32 operand of `size` elements lies: an activation or a loaded weight."""
        array = np.asarray(array)
        root = _root(array)
        if id(root) not in self.produced and self.constants.get(id(array)) is not array:
            self.fail("an operand made outside the recorded operations")
        elif array.dtype != np.float32 or not array.flags.c_contiguous or array.size != size:
            self.fail("an operand that is not a contiguous float32 array of the expected size")
        self.keep[id(array)] = array
        return array.ctypes.data

    def input(self, array, dtype) -> int:
        i = self._input_ids.get(id(array))
        if i is None or self.inputs[i][2] != dtype:
            self.fail("an index array that is not one of the batch's")
            return 0
        return i

    def matrix(self, m) -> int:
        if id(m) not in self._mat_ids:
            if self.mats and m.descriptor.dtype != self.mats[0].dtype:
                self.fail("matrices that name different sets of types (of different models)")
            self._mat_ids[id(m)] = len(self.mats)
            self.mats.append(m.descriptor)
            self.keep[id(m)] = m
        return self._mat_ids[id(m)]

    def cache(self, keys, values) -> int:
        index = self._cache_ids.get(id(keys))
        if index is None:
            index = self._cache_ids[id(keys)] = len(self.caches)
            self.keep[id(keys)], self.keep[id(values)] = keys, values
            keys, values = as_kernel_array(keys), as_kernel_array(values)
            if self.kv_dtype not in (None, keys.dtype) or keys.dtype != values.dtype or keys.ndim != 4:
                self.fail("caches of mixed or unknown layouts")
            self.kv_dtype = keys.dtype
            self.caches.append([keys.ctypes.data, *keys.shape, values.ctypes.data, *values.shape[1:]])
        return index

    def add(self, code, *args, params=()):
        row = [code, *[int(a) for a in args]]
        self.rows.append((row + [0] * (ARGS + 1 - len(row)), list(params) + [0.0] * (2 - len(params))))

    # --- operations, in the backend's words
    def embed(self, w, ids, out):
        self.embedding_rows.append(w.shape[0])
        self.add(EMBED, self.matrix(w), self.input(ids, np.int64), self.address(out, out.size), out.shape[1])

    def rms_norm(self, x, weight, eps, out):
        rows, width = out.shape
        self.add(RMS_NORM, self.address(x, out.size), self.address(weight, width), self.address(out, out.size),
                 rows, width, params=[eps])

    def products(self, stack, x, out):
        relabel = np.array([self.matrix(m) for m in stack.matrices], dtype=np.int64)
        tasks = stack.tasks.copy()
        tasks[:, 0] = relabel[stack.tasks[:, 0]]
        self.tasks.append(tasks)
        self.add(PRODUCTS, self.address(x, x.size), self.address(out, out.size), x.shape[0], x.shape[1],
                 out.shape[1], self.n_tasks, self.n_tasks + len(tasks), stack.formats)
        self.n_tasks += len(tasks)

    def rope_table(self, positions, n_rot, base, pos_scale, freq_factors):
        """The step's cos/sin tables for one rotation, made once per step and recorded."""
        key = (n_rot, base, pos_scale, None if freq_factors is None else freq_factors.tobytes())
        if key not in self.rope_tables:
            frequencies = ops.rope_frequencies(n_rot, base, freq_factors)
            self.keep[id(frequencies)] = frequencies
            cos, sin = (self.traced(table) for table in ops.rope_table(positions, frequencies, pos_scale))
            self.add(ROPE_TABLE, self.input(positions, np.int32), frequencies.ctypes.data, cos.shape[1],
                     self.address(cos, cos.size), self.address(sin, sin.size), params=[pos_scale])
            self.rope_tables[key] = cos, sin
        return self.rope_tables[key]

    def rope(self, x, cos, sin, neox):
        self.add(ROPE, self.address(x, x.size), *x.shape, self.address(cos, cos.size), self.address(sin, sin.size),
                 cos.shape[1], neox)

    def store_kv(self, keys, values, slots, k, v):
        self.add(STORE_KV, self.cache(keys, values), self.input(slots, np.int64), self.address(k, k.size),
                 self.address(v, v.size), k.shape[0], *head_dims(keys, values))

    def attention(self, q, keys, values, q_pos, k_pos, scale, window, softcap, out):
        group = q.shape[1] // keys.shape[0]
        if self.group not in (None, group):
            self.fail("layers with different numbers of queries per KV head")
        self.group = group
        self.add(ATTENTION, self.address(q, q.size), q.shape[0], q.shape[1], self.cache(keys, values),
                 self.input(q_pos, np.int32), self.input(k_pos, np.int32), self.address(out, out.size), window,
                 *head_dims(keys, values), params=[scale, softcap])

    def gated(self, code, gate, up):
        self.add(code, self.address(gate, gate.size), self.address(up, gate.size), *gate.shape)

    def softcap(self, x, cap, out):
        self.add(SOFTCAP, self.address(x, x.size), self.address(out, out.size), out.size, params=[cap])

    def ufunc(self, ufunc, method, inputs, kwargs, result):
        """Residual sums, biases and scale factors: x + y and x * s on activations."""
        arrays = [x for x in inputs if isinstance(x, np.ndarray) and x.ndim > 0]
        scalars = [x for x in inputs if not (isinstance(x, np.ndarray) and x.ndim > 0)]
        if method != "__call__" or kwargs or not isinstance(result, np.ndarray):
            self.fail(f"numpy {ufunc.__name__}.{method}")
            return result
        out = self.traced(result)
        if ufunc is np.add and len(arrays) == 2:
            self.add(ADD, *(self.address(x, result.size) for x in arrays), self.address(result, result.size),
                     result.size)
        elif ufunc is np.multiply and len(arrays) == 1 and len(scalars) == 1:
            self.add(SCALE, self.address(arrays[0], result.size), self.address(result, result.size), result.size,
                     params=[float(np.float32(scalars[0]))])
        else:
            self.fail(f"numpy {ufunc.__name__} of {len(arrays)} arrays")
        return out

    def program(self, output) -> StepProgram | None:
        if self.failed is not None:
            return None
        output = np.asarray(output)
        self.address(output, output.size)
        return StepProgram(self, output)


def _root(array):
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


class StepProgram:
    """A recorded step, ready to replay with a new batch."""

    def __init__(self, recorder: Recorder, output: np.ndarray):
        r = recorder
        self.code = np.array([row for row, _ in r.rows], dtype=np.int64).reshape(-1, ARGS + 1)
        self.params = np.array([p for _, p in r.rows], dtype=np.float64).reshape(-1, 2)
        self.mats = np.concatenate(r.mats) if r.mats else np.zeros(0, dtype=tagged_dtype(MATRIX, ()))
        self.tasks = np.concatenate(r.tasks)
        self.caches = np.array(r.caches, dtype=np.int64).reshape(-1, CACHE_COLUMNS)
        self.kv_like = np.zeros(0, dtype=r.kv_dtype or np.float32)
        self.rounding = rounding_kind(r.precise)
        self.group_tag = rows_tag(r.group or 1)
        self.inputs = r.inputs
        self.keep = list(r.keep.values())  # the memory the program names by address
        self.output = output
        self.id_limit = min(r.embedding_rows) if r.embedding_rows else None

    def replay(self, batch) -> np.ndarray:
        arrays = []
        for name, j, dtype in self.inputs:
            array = getattr(batch, name) if j is None else getattr(batch, name)[j]
            if array.dtype != dtype or not array.flags.c_contiguous:
                raise ValueError(f"batch field {name} changed its type since the step was recorded")
            arrays.append(array)
        if self.id_limit is not None:
            check_row_ids(batch.ids, self.id_limit)
        inputs = np.array([(a.ctypes.data, a.shape[0]) for a in arrays], dtype=np.int64)
        run_program(self.code, self.params, self.mats, self.tasks, self.caches, inputs, self.kv_like, self.rounding,
                    memory_streams(), self.group_tag)
        return self.output.copy()


REPLAY_KEY = "cpu step program"


def run_step(backend, compute, batch, replays: dict):
    """A one-token step: replayed from the cache's program, or run eagerly and recorded."""
    program = replays.get(REPLAY_KEY, False)
    if program is None:  # recorded once and found not replayable
        return compute(batch)
    if program is not False:
        return program.replay(batch)
    recorder = Recorder(batch, backend.constants, backend.precise)
    backend.recorder = recorder
    try:
        output = compute(batch)
    finally:
        backend.recorder = None
    replays[REPLAY_KEY] = recorder.program(output)
    return np.array(output)
