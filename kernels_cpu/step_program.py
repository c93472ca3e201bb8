"""Decode steps recorded once and replayed as one compiled call (the CPU's CUDA graphs).

A decode step of a small model is some 300 kernel calls. Called one by one from Python, the
interpreter, argument typing and per-call set-up cost more than a tenth of the step. So the
first one-token step of a model runs eagerly while a Recorder writes down each backend
operation: which kernel, on which memory. Later steps replay that program inside one Numba
function; the host only passes the step's inputs (token id, position, slots, the positions the
slots hold). A verified draft's pass of a few tokens is recorded and replayed the same way, one
program per number of tokens.

A program is a table of integer rows, one per operation (`Op`), whose operands are named and
typed by OPERANDS; they name memory by address: the activations the recording step allocated
(kept alive by the program and rewritten by every replay), the model's weights, and rows of a
cache table, which each replay binds to the buffers of the cache it runs over, so one recording,
which the backend keeps per model, serves every cache of the model (a recording costs a few eager
passes). Model code also computes with numpy operators (residual sums, biases, scales); during the
recording its arrays are `_Traced`, which records those too. Whatever the recorder cannot express
(an untraced temporary, a float weight matrix, an unknown numpy function, a read of an
activation's values into Python) marks the step not replayable, and it runs eagerly as before.
"""
from __future__ import annotations

import weakref
from enum import IntEnum

import numpy as np
from numba import carray, njit
from numba.extending import overload

from . import ops
from .attention import attention_lanes
from .intrinsics import pointer_at, rows_tag
from .kv_layout import as_kernel_array, head_dims, store_kv
from .activations import rounding_kind
from .cpu_features import memory_streams
from .type_sets import tagged_dtype
from .experts import combine, expert_products, expert_rows, route, sigmoid_gate
from .matmul import MATRIX, check_row_ids, dequantize_matrix_rows, products

class Op(IntEnum):
    """What a program's row does: its first column."""
    EMBED = 1        # out[t] = row ids[t] of the matrix
    SCALE = 2        # out = x * factor
    ADD = 3          # out = a + b
    RMS_NORM = 4
    PRODUCTS = 5     # out = the products of the stack's tasks with x
    ROPE_TABLE = 6   # the step's cos/sin tables of one rotation
    ROPE = 7
    STORE_KV = 8
    ATTENTION = 9
    SILU_MUL = 10    # gate = silu(gate) * up
    GELU_MUL = 11    # gate = gelu(gate) * up
    SOFTCAP = 12     # out = cap * tanh(x / cap)
    ROUTE = 13       # each token's chosen experts and their weights
    EXPERT_PRODUCTS = 14  # out = the products of x with the chosen experts of a stack's matrices
    COMBINE = 15     # out = the chosen experts' outputs weighted
    SIGMOID_GATE = 16  # x *= sigmoid(g)
    EXPERT_ROWS = 17   # out[s] = the table's row of slot s's expert
    CLAMPED_SWIGLU = 18  # gate = gpt-oss's clamped swiglu(gate, up)
    MULTIPLY = 19    # out = a * b (routing weights by per-expert factors: Gemma 4)
    COLUMNS = 20     # out = columns first.. of x (one matrix's products of a stack, for several tokens)
    UNARY = 21       # out = silu, sigmoid or softplus of x
    SHORT_CONV = 22  # out = a causal depthwise convolution of x over time, with a recurrent state
    DELTA_RULE = 23  # out = the gated delta rule over q, k, v, decay and beta, with a recurrent state
    SSM_SCAN = 24    # out = Mamba2's selective scan over x, dt, B and C, with a recurrent state


# What an operand names, which the recorder checks as it writes a row:
KINDS = {
    "f32": "the address of float32 memory the program keeps (an activation, a weight vector, a table)",
    "f64": "the address of float64 memory the program keeps",
    "i32": "the address of int32 memory the program keeps (expert ids)",
    "matrix": "a row of the program's products table",
    "tasks": "an index into the program's task table",
    "input": "one of the step's inputs (token ids, positions, slots)",
    "cache": "a row of the program's cache table",
    "state": "a row of the program's state table (a recurrent layer's state)",
    "count": "a size",
    "flag": "0 or 1",
    "formats": "the rounding formats of a product stack's weight types",
}


def _operation(name: str, params: tuple = (), **kinds):
    """An operation's integer operands (the columns after the code) and float parameters, by
    name: IntEnums the replay reads as constants, with the operands' kinds for the recorder."""
    operands = IntEnum(name, [(n.upper(), i) for i, n in enumerate(kinds)])
    operands.kinds, operands.params = kinds, params
    return operands, IntEnum(name + "Params", [(n.upper(), i) for i, n in enumerate(params)]) if params else None


Embed, _ = _operation("Embed", matrix="matrix", ids="input", out="f32", width="count")
Scale, ScaleParams = _operation("Scale", ("factor",), x="f32", out="f32", n="count")
# (b: n values, or one row of `width` that every row of a adds: a bias over several tokens)
Add, _ = _operation("Add", a="f32", b="f32", out="f32", n="count", width="count")
RmsNorm, RmsNormParams = _operation("RmsNorm", ("eps",), x="f32", weight="f32", out="f32", rows="count",
                                    width="count")
Products, _ = _operation("Products", x="f32", out="f32", tokens="count", k="count", n="count", first="tasks",
                         last="tasks", formats="formats")
RopeTable, RopeTableParams = _operation("RopeTable", ("position_scale", "magnitude"), positions="input",
                                        frequencies="f64",
                                        n="count", cos="f32", sin="f32")
Rope, _ = _operation("Rope", x="f32", tokens="count", heads="count", dim="count", cos="f32", sin="f32",
                     n="count", neox="flag")
StoreKv, _ = _operation("StoreKv", cache="cache", slots="input", k="f32", v="f32", tokens="count",
                        key_dim="count", value_dim="count")
# (lanes: sequences whose queries take rows starts[j]..; lane j's key positions are the input
# key_positions + j * lane_stride)
Attention, AttentionParams = _operation(
    "Attention", ("scale", "softcap"), q="f32", tokens="count", heads="count", cache="cache",
    query_positions="input", key_positions="input", out="f32", window="count", key_dim="count",
    value_dim="count", sinks="f32", group="flag", lanes="count", lane_stride="count", starts="i32")
Gated, _ = _operation("Gated", gate="f32", up="f32", rows="count", width="count")
Softcap, SoftcapParams = _operation("Softcap", ("cap",), x="f32", out="f32", n="count")
Route, RouteParams = _operation("Route", ("scale",), logits="f32", ids="i32", weights="f32", tokens="count",
                               experts="count", k="count", gating="count", norm="flag", bias="f32")
ExpertProducts, _ = _operation("ExpertProducts", x="f32", ids="i32", out="f32", x_rows="count", k="count",
                               slots="count", n="count", matrices="count", first="matrix", formats="formats")
Combine, _ = _operation("Combine", y="f32", weights="f32", out="f32", tokens="count", k="count", n="count")
SigmoidGate, _ = _operation("SigmoidGate", x="f32", g="f32", rows="count", width="count")
ExpertRows, _ = _operation("ExpertRows", table="f32", ids="i32", out="f32", experts="count", slots="count",
                           n="count")
ClampedSwiglu, ClampedSwigluParams = _operation("ClampedSwiglu", ("alpha", "limit"), **Gated.kinds)
Columns, _ = _operation("Columns", x="f32", out="f32", rows="count", stride="count", first="count", width="count")
Unary, _ = _operation("Unary", x="f32", out="f32", n="count", kind="count")
ShortConv, _ = _operation("ShortConv", x="f32", kernel="f32", out="f32", state="state", tokens="count",
                          channels="count", taps="count")
DeltaRule, _ = _operation("DeltaRule", q="f32", k="f32", v="f32", decay="f32", beta="f32", out="f32", state="state",
                          tokens="count", key_heads="count", value_heads="count", key_dim="count", value_dim="count",
                          grouped="flag")
SsmScan, _ = _operation("SsmScan", x="f32", dt="f32", b="f32", c="f32", a="f32", d="f32", out="f32", state="state",
                        tokens="count", heads="count", head_dim="count", groups="count", state_dim="count")
OPERANDS = {Op.EMBED: Embed, Op.SCALE: Scale, Op.ADD: Add, Op.RMS_NORM: RmsNorm, Op.PRODUCTS: Products,
            Op.ROPE_TABLE: RopeTable, Op.ROPE: Rope, Op.STORE_KV: StoreKv, Op.ATTENTION: Attention,
            Op.SILU_MUL: Gated, Op.GELU_MUL: Gated, Op.SOFTCAP: Softcap, Op.ROUTE: Route,
            Op.EXPERT_PRODUCTS: ExpertProducts, Op.COMBINE: Combine, Op.SIGMOID_GATE: SigmoidGate,
            Op.EXPERT_ROWS: ExpertRows, Op.CLAMPED_SWIGLU: ClampedSwiglu, Op.MULTIPLY: Add, Op.COLUMNS: Columns,
            Op.UNARY: Unary, Op.SHORT_CONV: ShortConv, Op.DELTA_RULE: DeltaRule, Op.SSM_SCAN: SsmScan}
ARGS = max(len(operands) for operands in OPERANDS.values())
PARAMS = max(len(operands.params) for operands in OPERANDS.values())
# columns of a program's cache table: keys (kv heads, tiles, dim, tile) and values (kv heads, slots, dim)
CACHE_COLUMNS = 8


# Whether a value is an operand of each kind, for a Recorder (see KINDS).
_VALID = {"f32": lambda r, v: v in r._memory, "f64": lambda r, v: v in r._memory, "i32": lambda r, v: v in r._memory,
          "matrix": lambda r, v: 0 <= v < len(r.mats), "tasks": lambda r, v: 0 <= v <= r.n_tasks,
          "input": lambda r, v: 0 <= v < len(r.inputs), "cache": lambda r, v: 0 <= v < len(r.cache_layers),
          "state": lambda r, v: 0 <= v < len(r.state_layers),
          "count": lambda r, v: v >= 0, "flag": lambda r, v: v in (0, 1), "formats": lambda r, v: v >= 0}


class NotReplayable(Exception):
    """The step does something the program cannot express."""


@njit(cache=True, inline="always")
def _f32(address, shape):
    return carray(pointer_at(address, np.float32), shape)


@njit(cache=True, inline="always")
def _i32(address, shape):
    return carray(pointer_at(address, np.int32), shape)


@njit(cache=True, inline="always")
def _input(inputs, i, dtype):
    return carray(pointer_at(inputs[i, 0], dtype), (inputs[i, 1],))


# A mixture of experts' operations: a program without them (a dense model's) compiles without
# their kernels, a large share of a first run's compile time.
MIXTURE_OPS = (Op.ROUTE, Op.EXPERT_PRODUCTS, Op.COMBINE, Op.SIGMOID_GATE, Op.EXPERT_ROWS)


def mixture_tag(has_mixture: bool) -> np.ndarray:
    """An empty array whose type says whether a program runs MIXTURE_OPS (fixed when it compiles)."""
    return np.empty(0, dtype=np.dtype([("mixture" if has_mixture else "dense", np.uint8)]))


def _mixture_op(tag, op, a, f, mats, rounding, streams):
    """Runs program row (op, a, f) if it is one of MIXTURE_OPS (and the tag says mixture)."""


@overload(_mixture_op)
def _mixture_op_impl(tag, op, a, f, mats, rounding, streams):
    if "mixture" not in tag.dtype.fields:
        return lambda tag, op, a, f, mats, rounding, streams: None

    def run(tag, op, a, f, mats, rounding, streams):
        if op == Op.ROUTE:
            shape = (a[Route.TOKENS], a[Route.K])
            route(_f32(a[Route.LOGITS], (a[Route.TOKENS], a[Route.EXPERTS])), a[Route.GATING], a[Route.NORM] != 0,
                  np.float32(f[RouteParams.SCALE]), _f32(a[Route.BIAS], (a[Route.EXPERTS],)),
                  _i32(a[Route.IDS], shape), _f32(a[Route.WEIGHTS], shape))
        elif op == Op.EXPERT_PRODUCTS:
            first, slots = a[ExpertProducts.FIRST], a[ExpertProducts.SLOTS]
            expert_products(mats[first:first + a[ExpertProducts.MATRICES]], _i32(a[ExpertProducts.IDS], (slots,)),
                            _f32(a[ExpertProducts.X], (a[ExpertProducts.X_ROWS], a[ExpertProducts.K])),
                            _f32(a[ExpertProducts.OUT], (a[ExpertProducts.MATRICES], slots, a[ExpertProducts.N])),
                            a[ExpertProducts.FORMATS], rounding, streams)
        elif op == Op.COMBINE:
            tokens, k, n = a[Combine.TOKENS], a[Combine.K], a[Combine.N]
            combine(_f32(a[Combine.Y], (tokens * k, n)), _f32(a[Combine.WEIGHTS], (tokens, k)),
                    _f32(a[Combine.OUT], (tokens, n)))
        elif op == Op.SIGMOID_GATE:
            rows = a[SigmoidGate.ROWS]
            sigmoid_gate(_f32(a[SigmoidGate.X], (rows, a[SigmoidGate.WIDTH])), _f32(a[SigmoidGate.G], (rows, 1)))
        elif op == Op.EXPERT_ROWS:
            slots, n = a[ExpertRows.SLOTS], a[ExpertRows.N]
            expert_rows(_f32(a[ExpertRows.TABLE], (a[ExpertRows.EXPERTS], n)), _i32(a[ExpertRows.IDS], (slots,)),
                        _f32(a[ExpertRows.OUT], (slots, n)))
    return run


# A hybrid's recurrent layers' operations, behind a tag of their own as a mixture's are.
RECURRENT_OPS = (Op.UNARY, Op.SHORT_CONV, Op.DELTA_RULE, Op.SSM_SCAN)


def recurrent_tag(has_recurrent: bool) -> np.ndarray:
    """An empty array whose type says whether a program runs RECURRENT_OPS (fixed when it compiles)."""
    return np.empty(0, dtype=np.dtype([("recurrent" if has_recurrent else "attention", np.uint8)]))


def _recurrent_op(tag, op, a, states):
    """Runs program row (op, a) if it is one of RECURRENT_OPS (and the tag says recurrent)."""


@overload(_recurrent_op)
def _recurrent_op_impl(tag, op, a, states):
    if "recurrent" not in tag.dtype.fields:
        return lambda tag, op, a, states: None

    def run(tag, op, a, states):
        if op == Op.UNARY:
            n = a[Unary.N]
            ops.unary(_f32(a[Unary.X], (n,)), a[Unary.KIND], _f32(a[Unary.OUT], (n,)))
        elif op == Op.SHORT_CONV:
            shape, taps = (a[ShortConv.TOKENS], a[ShortConv.CHANNELS]), a[ShortConv.TAPS]
            ops.short_conv(_f32(a[ShortConv.X], shape), _f32(a[ShortConv.KERNEL], (shape[1], taps)),
                           _f32(states[a[ShortConv.STATE]], (taps - 1, shape[1])), _f32(a[ShortConv.OUT], shape))
        elif op == Op.DELTA_RULE:
            tokens, d_k, d_v = a[DeltaRule.TOKENS], a[DeltaRule.KEY_DIM], a[DeltaRule.VALUE_DIM]
            keys, values = (tokens, a[DeltaRule.KEY_HEADS], d_k), (tokens, a[DeltaRule.VALUE_HEADS], d_v)
            gates = (tokens, a[DeltaRule.VALUE_HEADS])
            ops.delta_rule(_f32(a[DeltaRule.Q], keys), _f32(a[DeltaRule.K], keys), _f32(a[DeltaRule.V], values),
                           _f32(a[DeltaRule.DECAY], gates), _f32(a[DeltaRule.BETA], gates), a[DeltaRule.GROUPED],
                           _f32(states[a[DeltaRule.STATE]], (a[DeltaRule.VALUE_HEADS], d_k, d_v)),
                           _f32(a[DeltaRule.OUT], values))
        elif op == Op.SSM_SCAN:
            tokens, heads, head_dim = a[SsmScan.TOKENS], a[SsmScan.HEADS], a[SsmScan.HEAD_DIM]
            groups, d_state = a[SsmScan.GROUPS], a[SsmScan.STATE_DIM]
            rows, per_head = (tokens, heads, head_dim), (tokens, heads)
            grouped, weights = (tokens, groups, d_state), (heads,)
            ops.ssm_scan(_f32(a[SsmScan.X], rows), _f32(a[SsmScan.DT], per_head), _f32(a[SsmScan.B], grouped),
                         _f32(a[SsmScan.C], grouped), _f32(a[SsmScan.A], weights), _f32(a[SsmScan.D], weights),
                         _f32(states[a[SsmScan.STATE]], (heads, head_dim, d_state)), _f32(a[SsmScan.OUT], rows))
    return run


@njit(cache=True, nogil=True)
def run_program(code, params, mats, tasks, caches, inputs, kv_like, rounding, streams, group_tags, mixture,
                states, recurrent):
    """One replay of a recorded step; kv_like (empty) has the cache's element type, rounding
    (activations.rounding_kind) says how the products round activations, streams how they read
    the weights (cpu_features.memory_streams), group_tags the queries per KV head of attention
    (intrinsics.rows_tag), mixture (mixture_tag) whether it runs a mixture's operations; states
    the addresses of the recurrent states it updates, recurrent (recurrent_tag) whether it does.
    Without the GIL: a server's event loop streams the last step's tokens meanwhile."""
    for i in range(code.shape[0]):
        op, a, f = code[i, 0], code[i, 1:], params[i]
        if op == Op.EMBED:
            ids = _input(inputs, a[Embed.IDS], np.int64)
            dequantize_matrix_rows(mats, a[Embed.MATRIX], ids, _f32(a[Embed.OUT], (ids.shape[0], a[Embed.WIDTH])))
        elif op == Op.SCALE:
            n, factor = a[Scale.N], np.float32(f[ScaleParams.FACTOR])
            x, out = _f32(a[Scale.X], (n,)), _f32(a[Scale.OUT], (n,))
            for j in range(n):
                out[j] = x[j] * factor
        elif op == Op.ADD or op == Op.MULTIPLY:
            width = a[Add.WIDTH]
            shape = (a[Add.N] // width, width)
            x, y, out = _f32(a[Add.A], shape), _f32(a[Add.B], (width,)), _f32(a[Add.OUT], shape)
            for r in range(shape[0]):
                for j in range(width):
                    out[r, j] = x[r, j] + y[j] if op == Op.ADD else x[r, j] * y[j]
        elif op == Op.COLUMNS:
            rows, width, first = a[Columns.ROWS], a[Columns.WIDTH], a[Columns.FIRST]
            x, out = _f32(a[Columns.X], (rows, a[Columns.STRIDE])), _f32(a[Columns.OUT], (rows, width))
            for r in range(rows):
                for j in range(width):
                    out[r, j] = x[r, first + j]
        elif op == Op.RMS_NORM:
            shape = (a[RmsNorm.ROWS], a[RmsNorm.WIDTH])
            ops.rms_norm(_f32(a[RmsNorm.X], shape), _f32(a[RmsNorm.WEIGHT], (shape[1],)),
                         np.float32(f[RmsNormParams.EPS]), _f32(a[RmsNorm.OUT], shape))
        elif op == Op.PRODUCTS:
            tokens = a[Products.TOKENS]
            products(mats, tasks[a[Products.FIRST]:a[Products.LAST]], _f32(a[Products.X], (tokens, a[Products.K])),
                     _f32(a[Products.OUT], (tokens, a[Products.N])), a[Products.FORMATS], rounding, streams)
        elif op == Op.ROPE_TABLE:
            positions = _input(inputs, a[RopeTable.POSITIONS], np.int32)
            shape = (positions.shape[0], a[RopeTable.N])
            ops.rope_angles(positions, carray(pointer_at(a[RopeTable.FREQUENCIES], np.float64), (shape[1],)),
                            f[RopeTableParams.POSITION_SCALE], f[RopeTableParams.MAGNITUDE],
                            _f32(a[RopeTable.COS], shape),
                            _f32(a[RopeTable.SIN], shape))
        elif op == Op.ROPE:
            shape = (a[Rope.TOKENS], a[Rope.N])
            ops.rope(_f32(a[Rope.X], (a[Rope.TOKENS], a[Rope.HEADS], a[Rope.DIM])), _f32(a[Rope.COS], shape),
                     _f32(a[Rope.SIN], shape), a[Rope.NEOX] != 0)
        elif op == Op.STORE_KV:
            keys, values = _cache(caches, a[StoreKv.CACHE], kv_like)
            tokens, n_kv = a[StoreKv.TOKENS], keys.shape[0]
            store_kv(keys, values, _input(inputs, a[StoreKv.SLOTS], np.int64),
                     _f32(a[StoreKv.K], (tokens, n_kv, a[StoreKv.KEY_DIM])),
                     _f32(a[StoreKv.V], (tokens, n_kv, a[StoreKv.VALUE_DIM])))
        elif op == Op.ATTENTION:
            keys, values = _cache(caches, a[Attention.CACHE], kv_like)
            shape = (a[Attention.TOKENS], a[Attention.HEADS])
            q = _f32(a[Attention.Q], shape + (a[Attention.KEY_DIM],))
            out = _f32(a[Attention.OUT], shape + (a[Attention.VALUE_DIM],))
            q_pos = _input(inputs, a[Attention.QUERY_POSITIONS], np.int32)
            first, stride = a[Attention.KEY_POSITIONS], a[Attention.LANE_STRIDE]
            starts = _i32(a[Attention.STARTS], (a[Attention.LANES] + 1,))
            scale, softcap = np.float32(f[AttentionParams.SCALE]), np.float32(f[AttentionParams.SOFTCAP])
            sinks = _f32(a[Attention.SINKS], (shape[1],))
            # (each tag is a type, fixed when this compiles: one call site per tag)
            if a[Attention.GROUP] == 0:
                attention_lanes(q, keys, values, q_pos, inputs, first, stride, starts, scale, a[Attention.WINDOW],
                                softcap, sinks, out, group_tags[0])
            else:
                attention_lanes(q, keys, values, q_pos, inputs, first, stride, starts, scale, a[Attention.WINDOW],
                                softcap, sinks, out, group_tags[1])
        elif op == Op.SILU_MUL or op == Op.GELU_MUL:
            shape = (a[Gated.ROWS], a[Gated.WIDTH])
            gate, up = _f32(a[Gated.GATE], shape), _f32(a[Gated.UP], shape)
            if op == Op.SILU_MUL:
                ops.silu_mul(gate, up)
            else:
                ops.gelu_mul(gate, up)
        elif op == Op.SOFTCAP:
            n = a[Softcap.N]
            ops.softcap(_f32(a[Softcap.X], (n,)), np.float32(f[SoftcapParams.CAP]), _f32(a[Softcap.OUT], (n,)))
        elif op == Op.CLAMPED_SWIGLU:
            shape = (a[ClampedSwiglu.ROWS], a[ClampedSwiglu.WIDTH])
            ops.clamped_swiglu(_f32(a[ClampedSwiglu.GATE], shape), _f32(a[ClampedSwiglu.UP], shape),
                               np.float32(f[ClampedSwigluParams.ALPHA]), np.float32(f[ClampedSwigluParams.LIMIT]))
        elif op in RECURRENT_OPS:
            _recurrent_op(recurrent, op, a, states)
        else:
            _mixture_op(mixture, op, a, f, mats, rounding, streams)


@njit(cache=True, inline="always")
def _cache(caches, c, kv_like):
    row = caches[c]
    keys = carray(pointer_at(row[0], kv_like.dtype), (row[1], row[2], row[3], row[4]))
    return keys, carray(pointer_at(row[5], kv_like.dtype), (row[1], row[6], row[7]))


class _Traced(np.ndarray):
    """An activation of the recording step: numpy arithmetic on it is recorded as well, and any
    read of its values into Python (float(x), int(x), bool(x), x.item(), indexing by it, numpy
    functions such as argmax) marks the step not replayable: a value read once would be baked
    into every replay. (A copy made with np.asarray escapes this; verify_first_replay catches
    what that changes.)"""

    def __array_finalize__(self, obj):
        self.recorder = getattr(obj, "recorder", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [np.asarray(x) if isinstance(x, np.ndarray) else x for x in inputs]
        result = getattr(ufunc, method)(*plain, **kwargs)
        if self.recorder is None:
            return result
        return self.recorder.ufunc(ufunc, method, plain, kwargs, result)

    def __array_function__(self, func, types, args, kwargs):
        if func not in _SHAPE_ONLY:
            self._read(f"numpy {func.__name__}")
        return super().__array_function__(func, types, args, kwargs)

    def _read(self, what: str):
        if self.recorder is not None:
            self.recorder.fail(f"{what} reads an activation's values")

    def __getitem__(self, index):
        result = super().__getitem__(index)
        if not isinstance(result, np.ndarray):
            self._read("an element")
        elif any(isinstance(i, np.ndarray) for i in (index if isinstance(index, tuple) else (index,))):
            self._read("indexing by an array")
        return result


def _reads(name):
    def read(self, *args, **kwargs):
        self._read(f"{name}()")
        return getattr(np.ndarray, name)(self, *args, **kwargs)
    return read


for _name in ("__float__", "__int__", "__index__", "__bool__", "__complex__", "item", "tolist", "tobytes",
              "argmax", "argmin", "argsort", "argpartition", "nonzero", "searchsorted", "__repr__", "__str__"):
    setattr(_Traced, _name, _reads(_name))
# numpy functions that look at an activation's shape only
_SHAPE_ONLY = frozenset({np.shape, np.ndim, np.size, np.reshape, np.result_type, np.empty_like})


class Recorder:
    """Writes down a step's operations while the backend runs them eagerly (see module doc)."""

    def __init__(self, batch, constants, precise, cache_keys: list, cache_states: list = ()):
        self.precise = precise      # how the products round activations (the backend's choice)
        self.cache_keys = cache_keys  # the pass's cache's key buffers, per layer
        self.cache_states = list(cache_states)  # the pass's cache's recurrent states
        self.state_layers: list = []  # the state table's rows: the state each binds
        self.rows: list = []
        self.failed: str | None = None
        self.constants = constants  # id -> the weight vectors the backend loaded
        self.keep: dict = {}        # id -> every array the program reads or writes by address
        self._memory: set = set()   # the addresses of those arrays
        self.produced: set = set()  # ids of the step's own activations
        self.inputs: list = []      # the dtype of each of the batch's arrays (Batch.arrays)
        self._input_ids: dict = {}
        for array in batch.arrays():
            self._input_ids[id(array)] = len(self.inputs)
            self.inputs.append(array.dtype)
        self.mats: list = []        # products-table rows
        self.embedding_rows: list = []  # the row count of each embedding matrix (token ids must be below)
        self._mat_ids: dict = {}
        self.tasks = [np.zeros((0, 4), np.int64)]
        self.n_tasks = 0
        self.cache_layers: list = []  # the cache table's rows: the layer whose buffers each binds
        self._cache_ids: dict = {}
        self.rope_tables: dict = {}
        self.kv_dtype = None
        self.groups: list = []      # queries per KV head, at most two sizes (Gemma 4's global layers differ)

    # --- operands
    def fail(self, why: str):
        if self.failed is None:
            self.failed = why

    def traced(self, array):
        """A new activation of the step, returned to the model as a _Traced view."""
        root = _root(array)
        if root.dtype not in (np.float32, np.int32) or not root.flags.c_contiguous:
            self.fail("an activation that is not contiguous float32 (or int32 expert ids)")
        self.produced.add(id(root))
        self.keep[id(root)] = root
        view = array.view(_Traced)
        view.recorder = self
        return view

    def address(self, array, size: int, dtype=np.float32) -> int:
        """Where an operand of `size` elements lies: an activation or a loaded weight (float32),
        or expert ids (int32)."""
        array = np.asarray(array)
        root = _root(array)
        if id(root) not in self.produced and self.constants.get(id(array)) is not array:
            self.fail("an operand made outside the recorded operations")
        elif array.dtype != dtype or not array.flags.c_contiguous or array.size != size:
            self.fail(f"an operand that is not a contiguous {np.dtype(dtype).name} array of the expected size")
        self.keep[id(array)] = array
        at = array.ctypes.data
        self._memory.add(at)
        return at

    def constant(self, array) -> int:
        """The address of an array of the program's own, kept as the recording made it."""
        self.keep[id(array)] = array
        self._memory.add(array.ctypes.data)
        return array.ctypes.data

    def input(self, array, dtype) -> int:
        i = self._input_ids.get(id(array))
        if i is None or self.inputs[i] != dtype:
            self.fail("an index array that is not one of the batch's")
            return 0
        return i

    def matrix(self, m) -> int:
        """m's row of the products table."""
        if id(m) not in self._mat_ids:
            self._mat_ids[id(m)] = self._append_matrix(m)
        return self._mat_ids[id(m)]

    def _append_matrix(self, m) -> int:
        if self.mats and m.descriptor.dtype != self.mats[0].dtype:
            self.fail("matrices that name different sets of types (of different models)")
        self.mats.append(m.descriptor)
        self.keep[id(m)] = m
        return len(self.mats) - 1

    def cache(self, keys, values) -> int:
        index = self._cache_ids.get(id(keys))
        if index is None:
            index = self._cache_ids[id(keys)] = len(self.cache_layers)
            layer = next((i for i, k in enumerate(self.cache_keys) if k is keys), None)
            keys, values = as_kernel_array(keys), as_kernel_array(values)
            if layer is None:
                self.fail("keys that are not a layer's of the pass's cache")
            elif self.kv_dtype not in (None, keys.dtype) or keys.dtype != values.dtype or keys.ndim != 4:
                self.fail("caches of mixed or unknown layouts")
            self.kv_dtype = keys.dtype
            self.cache_layers.append(layer)
        return index

    def state(self, array) -> int:
        """The state table's row of one of the cache's recurrent states."""
        index = next((i for i, s in enumerate(self.cache_states) if s is array), None)
        if index is None:
            self.fail("a state that is not one of the pass's cache's")
            return 0
        if index not in self.state_layers:
            self.state_layers.append(index)
        return self.state_layers.index(index)

    def add(self, op: Op, **named):
        """A row of the program: op with its operands and parameters by name (OPERANDS[op]), each
        operand checked against its kind."""
        operands = OPERANDS[op]
        if set(named) != set(operands.kinds) | set(operands.params):
            raise TypeError(f"{op.name} takes {', '.join([*operands.kinds, *operands.params])}, not {', '.join(named)}")
        row = [int(op)] + [self._operand(op, name, kind, named[name]) for name, kind in operands.kinds.items()]
        params = [float(named[name]) for name in operands.params]
        self.rows.append((row + [0] * (ARGS + 1 - len(row)), params + [0.0] * (PARAMS - len(params))))

    def _operand(self, op: Op, name: str, kind: str, value) -> int:
        value = int(value)
        if self.failed is not None:  # not a program any more: the step just runs eagerly
            return value
        if not _VALID[kind](self, value):
            raise TypeError(f"{op.name}'s {name} = {value} is not {KINDS[kind]}")
        return value

    # --- operations, in the backend's words
    def embed(self, w, ids, out):
        self.embedding_rows.append(w.shape[0])
        self.add(Op.EMBED, matrix=self.matrix(w), ids=self.input(ids, np.int64), out=self.address(out, out.size),
                 width=out.shape[1])

    def rms_norm(self, x, weight, eps, out):
        rows, width = out.shape
        self.add(Op.RMS_NORM, x=self.address(x, out.size), weight=self.address(weight, width),
                 out=self.address(out, out.size), rows=rows, width=width, eps=eps)

    def products(self, stack, x, out):
        relabel = np.array([self.matrix(m) for m in stack.matrices], dtype=np.int64)
        tasks = stack.tasks.copy()
        tasks[:, 0] = relabel[stack.tasks[:, 0]]
        self.tasks.append(tasks)
        self.n_tasks += len(tasks)
        self.add(Op.PRODUCTS, x=self.address(x, x.size), out=self.address(out, out.size), tokens=x.shape[0],
                 k=x.shape[1], n=out.shape[1], first=self.n_tasks - len(tasks), last=self.n_tasks,
                 formats=stack.formats)

    def columns(self, x, first, out):
        rows, width = out.shape
        self.add(Op.COLUMNS, x=self.address(x, x.size), out=self.address(out, out.size), rows=rows,
                 stride=x.shape[1], first=first, width=width)

    def rope_table(self, positions, n_rot, base, pos_scale, freq_factors, magnitude):
        """The step's cos/sin tables for one rotation, made once per step and recorded."""
        key = (n_rot, base, pos_scale, None if freq_factors is None else freq_factors.tobytes(), magnitude)
        if key not in self.rope_tables:
            frequencies = ops.rope_frequencies(n_rot, base, freq_factors)
            cos, sin = (self.traced(table) for table in ops.rope_table(positions, frequencies, pos_scale, magnitude))
            self.add(Op.ROPE_TABLE, positions=self.input(positions, np.int32), frequencies=self.constant(frequencies),
                     n=cos.shape[1], cos=self.address(cos, cos.size), sin=self.address(sin, sin.size),
                     position_scale=pos_scale, magnitude=magnitude)
            self.rope_tables[key] = cos, sin
        return self.rope_tables[key]

    def rope(self, x, positions, n_rot, base, pos_scale, neox, freq_factors, magnitude):
        """x rotated in place by the step's own cos/sin tables, which every replay rewrites (the
        recording pass rotates it by the backend's tables of the same values)."""
        cos, sin = self.rope_table(positions, n_rot, base, pos_scale, freq_factors, magnitude)
        tokens, heads, dim = x.shape
        self.add(Op.ROPE, x=self.address(x, x.size), tokens=tokens, heads=heads, dim=dim,
                 cos=self.address(cos, cos.size), sin=self.address(sin, sin.size), n=cos.shape[1], neox=neox)

    def store_kv(self, keys, values, slots, k, v):
        key_dim, value_dim = head_dims(keys, values)
        self.add(Op.STORE_KV, cache=self.cache(keys, values), slots=self.input(slots, np.int64),
                 k=self.address(k, k.size), v=self.address(v, v.size), tokens=k.shape[0], key_dim=key_dim,
                 value_dim=value_dim)

    def attention(self, q, keys, values, q_pos, key_positions, starts, scale, window, softcap, sinks, out):
        """Attention of lanes (attention.few_attention: key_positions, one array per lane, are the
        batch's arrays, a lane's as far from the one before as every other's)."""
        lanes = [self.input(k_pos, np.int32) for k_pos in key_positions]
        strides = {b - a for a, b in zip(lanes, lanes[1:])}
        if len(strides) > 1:
            self.fail("lanes whose key positions lie unevenly among the batch's arrays")
        group = q.shape[1] // keys.shape[0]
        if group not in self.groups:
            self.groups.append(group)
        if len(self.groups) > 2:
            self.fail("layers with more than two numbers of queries per KV head")
        key_dim, value_dim = head_dims(keys, values)
        self.add(Op.ATTENTION, q=self.address(q, q.size), tokens=q.shape[0], heads=q.shape[1],
                 cache=self.cache(keys, values), query_positions=self.input(q_pos, np.int32),
                 key_positions=lanes[0], out=self.address(out, out.size), window=window,
                 key_dim=key_dim, value_dim=value_dim, sinks=self.address(sinks, q.shape[1]),
                 group=min(self.groups.index(group), 1), lanes=len(lanes), lane_stride=strides.pop() if strides else 0,
                 starts=self.constant(np.asarray(starts, dtype=np.int32)), scale=scale, softcap=softcap)

    def _gated(self, op: Op, gate, up, **params):
        """gate = act(gate) * up, with the activation's parameters (the clamped SwiGLU's)."""
        rows, width = gate.shape
        self.add(op, gate=self.address(gate, gate.size), up=self.address(up, gate.size), rows=rows, width=width,
                 **params)

    def silu_mul(self, gate, up):
        self._gated(Op.SILU_MUL, gate, up)

    def gelu_mul(self, gate, up):
        self._gated(Op.GELU_MUL, gate, up)

    def clamped_swiglu(self, gate, up, alpha, limit):
        self._gated(Op.CLAMPED_SWIGLU, gate, up, alpha=alpha, limit=limit)

    def softcap(self, x, cap, out):
        self.add(Op.SOFTCAP, x=self.address(x, x.size), out=self.address(out, out.size), n=out.size, cap=cap)

    def route(self, logits, gating, norm, scale, bias, ids, weights):
        tokens, k = ids.shape
        self.add(Op.ROUTE, logits=self.address(logits, logits.size), ids=self.address(ids, ids.size, np.int32),
                 weights=self.address(weights, weights.size), tokens=tokens, experts=logits.shape[1], k=k,
                 gating=gating, norm=norm, bias=self.address(bias, logits.shape[1]), scale=scale)

    def expert_products(self, stack, x, ids, out):
        # the stack's matrices as consecutive rows of the table
        first = [self._append_matrix(m) for m in stack.matrices][0]
        self.add(Op.EXPERT_PRODUCTS, x=self.address(x, x.size), ids=self.address(ids, ids.size, np.int32),
                 out=self.address(out, out.size), x_rows=x.shape[0], k=x.shape[1], slots=ids.size, n=out.shape[2],
                 matrices=len(stack.matrices), first=first, formats=stack.formats)

    def combine(self, y, weights, out):
        tokens, k = weights.shape
        self.add(Op.COMBINE, y=self.address(y, y.size), weights=self.address(weights, weights.size),
                 out=self.address(out, out.size), tokens=tokens, k=k, n=out.shape[1])

    def unary(self, x, kind, out):
        self.add(Op.UNARY, x=self.address(x, x.size), out=self.address(out, out.size), n=out.size, kind=kind)

    def short_conv(self, x, kernel, state, out):
        self.add(Op.SHORT_CONV, x=self.address(x, x.size), kernel=self.address(kernel, kernel.size),
                 out=self.address(out, out.size), state=self.state(state), tokens=x.shape[0], channels=x.shape[1],
                 taps=kernel.shape[1])

    def delta_rule(self, q, k, v, decay, beta, state, grouped, out):
        self.add(Op.DELTA_RULE, q=self.address(q, q.size), k=self.address(k, k.size), v=self.address(v, v.size),
                 decay=self.address(decay, decay.size), beta=self.address(beta, beta.size),
                 out=self.address(out, out.size), state=self.state(state), tokens=q.shape[0], key_heads=q.shape[1],
                 value_heads=v.shape[1], key_dim=q.shape[2], value_dim=v.shape[2], grouped=int(grouped))

    def ssm_scan(self, x, dt, b, c, a, d, state, out):
        self.add(Op.SSM_SCAN, **{name: self.address(v, v.size) for name, v in
                                 (("x", x), ("dt", dt), ("b", b), ("c", c), ("a", a), ("d", d), ("out", out))},
                 state=self.state(state), tokens=x.shape[0], heads=x.shape[1], head_dim=x.shape[2], groups=b.shape[1],
                 state_dim=b.shape[2])

    def sigmoid_gate(self, x, g):
        rows, width = x.shape
        self.add(Op.SIGMOID_GATE, x=self.address(x, x.size), g=self.address(g, rows), rows=rows, width=width)

    def expert_rows(self, table, ids, out):
        self.add(Op.EXPERT_ROWS, table=self.address(table, table.size), ids=self.address(ids, ids.size, np.int32),
                 out=self.address(out, out.size), experts=table.shape[0], slots=ids.size, n=table.shape[1])

    def ufunc(self, ufunc, method, inputs, kwargs, result):
        """Residual sums, biases and scale factors: x + y, x * y and x * s on activations (x and y
        of one size, or y one row that every row of x takes: a bias over several tokens; another
        broadcast fails address's size check)."""
        arrays = [x for x in inputs if isinstance(x, np.ndarray) and x.ndim > 0]
        scalars = [x for x in inputs if not (isinstance(x, np.ndarray) and x.ndim > 0)]
        if method != "__call__" or kwargs or not isinstance(result, np.ndarray):
            self.fail(f"numpy {ufunc.__name__}.{method}")
            return result
        out = self.traced(result)
        n = result.size
        if ufunc in (np.add, np.multiply) and len(arrays) == 2:
            x, y = sorted(arrays, key=lambda a: -a.size)  # (both commute, bit for bit)
            width = y.size if y.size < n and y.ndim == 1 and result.shape[-1] == y.size else n
            self.add(Op.ADD if ufunc is np.add else Op.MULTIPLY, a=self.address(x, n), b=self.address(y, width),
                     out=self.address(result, n), n=n, width=width)
        elif ufunc is np.multiply and len(arrays) == 1 and len(scalars) == 1:
            self.add(Op.SCALE, x=self.address(arrays[0], n), out=self.address(result, n), n=n,
                     factor=float(np.float32(scalars[0])))
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
        self.cache_layers = r.cache_layers
        self.caches = np.zeros((len(r.cache_layers), CACHE_COLUMNS), dtype=np.int64)
        self._bound: list = []  # weak references to the buffers the cache table names now
        self.kv_like = np.zeros(0, dtype=r.kv_dtype or np.float32)
        self.rounding = rounding_kind(r.precise)
        groups = r.groups or [1]
        self.group_tags = (rows_tag(groups[0]), rows_tag(groups[-1]))
        self.mixture = mixture_tag(bool(np.isin(self.code[:, 0], MIXTURE_OPS).any()))
        self.recurrent = recurrent_tag(bool(np.isin(self.code[:, 0], RECURRENT_OPS).any()))
        self.state_layers = r.state_layers
        self.states = np.zeros(len(r.state_layers), dtype=np.int64)  # their addresses, bound at each replay
        self.inputs = r.inputs
        self.keep = list(r.keep.values())  # the memory the program names by address
        self.output = output
        self.id_limit = min(r.embedding_rows) if r.embedding_rows else None

    def bind(self, cache_keys: list, cache_values: list) -> None:
        """Point the cache table at these buffers (a cache's, per layer), unless it names them."""
        buffers = [(cache_keys[i], cache_values[i]) for i in self.cache_layers]
        if len(self._bound) == len(buffers) and all(ref() is k for ref, (k, _) in zip(self._bound, buffers)):
            return
        for row, (keys, values) in zip(self.caches, buffers):
            keys, values = as_kernel_array(keys), as_kernel_array(values)
            if keys.dtype != self.kv_like.dtype:  # (the backend keeps a program per element type)
                raise ValueError(f"a cache of {keys.dtype} elements for a pass recorded over {self.kv_like.dtype}")
            row[:] = [keys.ctypes.data, *keys.shape, values.ctypes.data, *values.shape[1:]]
        self._bound = [weakref.ref(keys) for keys, _ in buffers]

    def replay(self, batch, cache_keys: list, cache_values: list, cache_states: list = ()) -> np.ndarray:
        arrays = batch.arrays()
        if len(arrays) != len(self.inputs):
            raise ValueError("a batch of another shape than the recorded step's")
        for array, dtype in zip(arrays, self.inputs):
            if array.dtype != dtype or not array.flags.c_contiguous:
                raise ValueError("a batch array changed its type since the step was recorded")
        if self.id_limit is not None:
            check_row_ids(batch.ids, self.id_limit)
        self.bind(cache_keys, cache_values)
        for row, index in enumerate(self.state_layers):  # (each sequence's own: bound at every replay)
            state = cache_states[index]
            if state.dtype != np.float32 or not state.flags.c_contiguous:
                raise ValueError("a recurrent state that is not contiguous float32")
            self.states[row] = state.ctypes.data
        inputs = np.array([(a.ctypes.data, a.shape[0]) for a in arrays], dtype=np.int64)
        run_program(self.code, self.params, self.mats, self.tasks, self.caches, inputs, self.kv_like, self.rounding,
                    memory_streams(), self.group_tags, self.mixture, self.states, self.recurrent)
        return self.output.copy()


def batch_shape(batch) -> tuple:
    """What a pass's recording depends on besides its batch's values: its tokens, each lane's
    tokens (Batch.lanes), and how many arrays the batch has (its cache's kinds of layer: a plain
    cache keeps a sliding window's apart, a pool does not)."""
    return len(batch.ids), tuple(len(lane.ids) for lane in batch.lanes), len(batch.arrays())


def run_step(backend, compute, batch, programs: dict, shape, memory):
    """A pass of a few tokens (a decode step, a verified draft): replayed from programs[shape]
    (the backend's for the pass's model: one program per kv type, all_logits and batch_shape;
    None where the shape does not replay), bound to memory's buffers, or run eagerly and recorded.
    A backend's first replay of each shape also runs eagerly (a pass over the same slots writes the
    same keys and values, so the two agree bit for bit) and drops the program if they differ: a
    value the model read past the tracing would otherwise be replayed as the recording pass saw
    it, silently. (Its model's code is the same over every cache, so one check per backend and
    shape tells.)"""
    program = programs.get(shape, False)
    states = getattr(memory, "states", ())
    if program is None:  # recorded once and found not replayable
        return compute(batch)
    if program is not False:
        checked = (*shape, *program.output.shape)
        if checked in backend.replay_checked:
            return program.replay(batch, memory.keys, memory.values, states)
        before = [s.copy() for s in states]  # (the eager pass that checks the replay starts where it did)
        replayed = program.replay(batch, memory.keys, memory.values, states)
        for state, kept in zip(states, before):
            state[...] = kept
        eager = np.array(compute(batch))
        if np.array_equal(replayed, eager):
            backend.replay_checked.add(checked)
        else:
            programs[shape] = None
        return eager
    recorder = Recorder(batch, backend.constants, backend.precise, memory.keys, states)
    backend.recorder = recorder
    try:
        output = compute(batch)
    finally:
        backend.recorder = None
    programs[shape] = recorder.program(output)
    return np.array(output)
