"""runner.engine.backend.Backend on the CPU: Numba kernels over numpy arrays."""
from __future__ import annotations

import os
import weakref

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from . import amx, ops
from .attention import MASKED, SLOT_CHUNK, attention, few_attention
from .bandwidth import read_bandwidth
from .blocks import SUPPORTED_TYPES
from .activations import rounding_kind
from .cpu_features import int8_isa, memory_streams
from .heap import keep_freed_memory
from .experts import (GATING, ExpertStack, check_expert_ids, combine, expert_products, expert_rows,
                      grouped_products, route, sigmoid_gate)
from .kv_layout import ELEMENTS, as_kernel_array, cached_rows, export_rows, import_rows, new_cache, store_kv
from .matmul import FEW_TOKENS, decode_stack, load_matrix, matmuls, stacked
from .step_program import Recorder, batch_shape, run_step
from .type_sets import WeightTypes


class CpuBackend:
    name = "cpu"
    few_tokens = FEW_TOKENS
    replays_states = True  # (a recorded pass binds the recurrent states of the cache it replays over)
    replays_lanes = True   # (and the slots and positions of each lane's batch)
    supported_types = SUPPORTED_TYPES
    kv_types = tuple(ELEMENTS)
    kv_block = SLOT_CHUNK  # (attention's jobs: one that sees none of its slots skips them)

    def __init__(self, threads: int | None = None, precise: bool = False):
        # precise: decode's products take 16-bit activations (rowdot.py), not llama.cpp's 8-bit ones
        self.precise = precise
        self.threads = max(1, min(threads or os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.threads)
        # Numba's OpenMP workers spin between parallel regions; a multi-threaded BLAS running
        # beside them (prefill tiles) would fight them for the cores.
        threadpool_limits(1, user_api="blas")
        keep_freed_memory()
        self._rope_tables: dict = {}
        self._no_sinks: dict = {}  # heads -> sink logits that take no weight
        self._no_bias: dict = {}   # experts -> an expert selection bias of zeros
        self.constants = weakref.WeakValueDictionary()  # id -> weight vector (a step program reads them)
        self.recorder = None  # a step_program.Recorder while a decode step is being recorded
        self.replay_checked = set()  # pass shapes whose replay agreed with an eager pass (step_program.run_step)
        # owner -> {(kv type, tokens, all_logits): StepProgram, or None where that shape does not
        # replay}: weak keys, so that a model's programs go with it
        self._programs = weakref.WeakKeyDictionary()
        self.record_steps = True  # False: every pass runs eagerly (what tests compare replays against)
        self.quant_types = WeightTypes()  # of the model's matrices: the kernels compile for these alone

    @property
    def label(self):
        return "cpu+amx" if amx.usable() else "cpu"

    @property
    def decode_products(self):
        if self.precise:
            return "16-bit activations (--precise)"
        return f"8-bit activations, {int8_isa()} instructions"

    def free_memory(self):
        return None

    def run(self, compute, batch, memory=None, owner=None, all_logits=False):
        if memory is None or not self.record_steps:
            return compute(batch)
        shape = (memory.kv_type, all_logits, *batch_shape(batch))
        return run_step(self, compute, batch, self._programs.setdefault(owner, {}), shape, memory)

    def recorded_program(self, owner, kv_type, n_tokens, all_logits, lanes=()):
        """The step program of owner's passes of this shape (Backend.run; lanes: the tokens of
        each lane, where a pass has lanes); None where the shape does not replay; KeyError before
        the first such pass."""
        found = [program for (kind, logits, tokens, lane_tokens, _), program in self._programs[owner].items()
                 if (kind, logits, tokens, lane_tokens) == (kv_type, all_logits, n_tokens, lanes)]
        if not found:
            raise KeyError((kv_type, n_tokens, all_logits, lanes))
        return found[-1]

    def _record(self, record, *args, out=None):
        """What the model gets of an operation's output `out` (an array, a tuple of them, or None
        for an operation in place): while a pass is recorded, traced, with record (a Recorder
        method) called on (*args, *traced outputs); else out itself."""
        if self.recorder is None:
            return out
        outs = out if isinstance(out, tuple) else () if out is None else (out,)
        traced = tuple(map(self.recorder.traced, outs))
        record(self.recorder, *args, *traced)
        return traced if isinstance(out, tuple) else traced[0] if traced else None

    def upload(self, batch):
        return batch

    def to_numpy(self, x):
        return x

    def concat(self, xs):
        out = np.concatenate([x.view(np.ndarray) for x in xs])
        if self.recorder is None:
            return out
        traced, row = self.recorder.traced(out), 0  # (each part copied into its rows, by a recorded op)
        for x in xs:
            rows = len(x)
            self.recorder.columns(x.reshape(rows, -1), 0, traced[row:row + rows].reshape(rows, -1))
            row += rows
        return traced

    def softcap(self, x, cap):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        ops.softcap(x.reshape(-1), np.float32(cap), out.reshape(-1))
        return self._record(Recorder.softcap, x, cap, out=out)

    def load_matrix(self, qtype, raw, k):
        # decode's 8-bit products take interleaved groups (copies of the rows), its precise
        # 16-bit ones the file's rows
        return load_matrix(qtype, raw, k, interleaved=not self.precise, types=self.quant_types)

    def load_table(self, qtype, raw, k):
        return load_matrix(qtype, raw, k, types=self.quant_types)  # (rows read in place: no copy)

    def load_experts(self, qtype, raw, k, experts):
        return load_matrix(qtype, raw, k, interleaved=not self.precise, types=self.quant_types, experts=experts)

    def load_vector(self, values):
        vector = np.ascontiguousarray(values, dtype=np.float32)
        self.constants[id(vector)] = vector
        return vector

    def asarray(self, values):
        return np.ascontiguousarray(values)

    def matmul(self, w, x):
        return self.matmuls([w], x)[0]

    def matmuls(self, ws, x):
        stack = decode_stack(ws, x)
        if stack is None:
            self._record(Recorder.fail, "products that do not run the decode kernel")
            return matmuls(ws, x, self.precise)
        out = self._record(Recorder.products, stack, x, out=stack.products(x, self.precise))
        return self.split(out, [b - a for a, b in stack.spans])

    def split(self, x, widths):
        starts = np.cumsum([0, *widths[:-1]]).tolist()
        if x.shape[0] == 1 or len(widths) == 1:  # (one row's pieces are contiguous already)
            return [x[:, a:a + w] for a, w in zip(starts, widths)]
        # several tokens' pieces copied out contiguous, which a recorded pass can name (and the
        # kernels after them take as they take one token's)
        return [self._record(Recorder.columns, x, a, out=x.view(np.ndarray)[:, a:a + w].copy())
                for a, w in zip(starts, widths)]

    def route(self, logits, k, gating, norm, scale, selection_bias=None):
        logits = np.ascontiguousarray(logits)
        n_expert = logits.shape[1]
        if selection_bias is None:  # (a bias of zeros changes no choice)
            selection_bias = self._no_bias.get(n_expert)
            if selection_bias is None:
                selection_bias = self._no_bias[n_expert] = self.load_vector(np.zeros(n_expert, np.float32))
        if selection_bias.shape != (n_expert,) or selection_bias.dtype != np.float32:
            raise ValueError(f"a selection bias of shape {selection_bias.shape} for {n_expert} experts")
        ids = np.empty((logits.shape[0], k), dtype=np.int32)
        weights = np.empty((logits.shape[0], k), dtype=np.float32)
        route(logits, GATING[gating], norm, np.float32(scale), selection_bias, ids, weights)
        return self._record(Recorder.route, logits, GATING[gating], norm, scale, selection_bias, out=(ids, weights))

    def expert_matmuls(self, ws, x, ids):
        x = np.ascontiguousarray(x)
        if ids.shape[0] > 1:  # many tokens: expert by expert (not recorded: steps are one token)
            self._record(Recorder.fail, "expert products of several tokens")
            return grouped_products(ws, x, np.asarray(ids), self.precise)
        stack = stacked([w.as_rows for w in ws] if self.precise else ws, ExpertStack)
        slots = ids.view(np.ndarray).reshape(-1)  # (the backend's own check, not a read of the model's)
        check_expert_ids(slots, stack.n_expert)
        out = np.empty((len(ws), slots.size, stack.n_rows), dtype=np.float32)
        expert_products(stack.mats, slots, x, out, stack.formats, rounding_kind(self.precise), memory_streams())
        out = self._record(Recorder.expert_products, stack, x, ids, out=out)
        return [out[m] for m in range(len(ws))]

    def expert_rows(self, table, ids):
        slots = ids.view(np.ndarray).reshape(-1)  # (the backend's own check, not a read of the model's)
        check_expert_ids(slots, table.shape[0])
        out = np.empty((slots.size, table.shape[1]), dtype=np.float32)
        expert_rows(table, slots, out)
        return self._record(Recorder.expert_rows, table, ids, out=out)

    def expert_combine(self, y, weights):
        y = np.ascontiguousarray(y)
        out = np.empty((weights.shape[0], y.shape[1]), dtype=np.float32)
        combine(y, weights, out)
        return self._record(Recorder.combine, y, weights, out=out)

    def sigmoid_gate(self, x, g):
        sigmoid_gate(x, g)
        self._record(Recorder.sigmoid_gate, x, g)
        return x

    def embed(self, w, ids):
        return self._record(Recorder.embed, w, ids, out=w.rows(ids))

    def rms_norm(self, x, weight, eps):
        # (rows of a strided view, as Q and K of a stacked product are for several tokens, would
        # run another specialization whose sums round differently: a token's norm would then
        # depend on how many tokens share the pass, and speculative decoding's checks on that)
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        ops.rms_norm(x, weight, np.float32(eps), out)
        return self._record(Recorder.rms_norm, x, weight, eps, out=out)

    def rope(self, x, positions, n_rot, base, pos_scale, neox, freq_factors, magnitude=1.0):
        cos, sin = self._rope_table(positions, n_rot, base, pos_scale, freq_factors, magnitude)
        ops.rope(x, cos, sin, neox)
        self._record(Recorder.rope, x, positions, n_rot, base, pos_scale, neox, freq_factors, magnitude)

    def _rope_table(self, positions, n_rot, base, pos_scale, freq_factors, magnitude):
        """cos/sin tables, kept for the few most recent position sets: every layer of a forward
        pass rotates its queries and keys at the same positions, with one or two RoPE bases."""
        key = (positions.tobytes(), n_rot, base, pos_scale, None if freq_factors is None else freq_factors.tobytes(),
               magnitude)
        table = self._rope_tables.pop(key, None)
        if table is None:
            table = ops.rope_table(positions, ops.rope_frequencies(n_rot, base, freq_factors), pos_scale, magnitude)
        self._rope_tables[key] = table
        while len(self._rope_tables) > 4:
            del self._rope_tables[next(iter(self._rope_tables))]
        return table

    def read_bandwidth(self):
        return read_bandwidth()

    def new_state(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def read_state(self, state):
        return state.copy()

    def write_state(self, state, values):
        state[...] = values

    def unary(self, x, kind):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        ops.unary(x.reshape(-1), ops.UNARY[kind], out.reshape(-1))
        return self._record(Recorder.unary, x, ops.UNARY[kind], out=out)

    def delta_rule(self, q, k, v, decay, beta, state, grouped=False):
        q, k, v, decay, beta = map(np.ascontiguousarray, (q, k, v, decay, beta))
        out = np.empty_like(v)
        ops.delta_rule(q, k, v, decay, beta, grouped, state, out)
        return self._record(Recorder.delta_rule, q, k, v, decay, beta, state, grouped, out=out)

    def ssm_scan(self, x, dt, b, c, a, d, state):
        x, dt, b, c = map(np.ascontiguousarray, (x, dt, b, c))
        ops.check_ssm_shapes(x, dt, b, c, a, d, state)
        out = np.empty_like(x)
        ops.ssm_scan(x, dt, b, c, a, d, state, out)
        return self._record(Recorder.ssm_scan, x, dt, b, c, a, d, state, out=out)

    def short_conv(self, x, kernel, state):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        ops.short_conv(x, kernel, state, out)
        return self._record(Recorder.short_conv, x, kernel, state, out=out)

    def new_kv(self, n_kv, key_dim, value_dim, slots, kv_type):
        return new_cache(n_kv, key_dim, value_dim, slots, kv_type)

    def read_kv(self, keys, values, n):
        return cached_rows(keys, values, n)

    def export_kv(self, keys, values, slots):
        return export_rows(keys, values, slots)

    def import_kv(self, keys, values, slots, key_rows, value_rows):
        import_rows(keys, values, slots, key_rows, value_rows)

    def store_kv(self, keys, values, slots, k, v):
        store_kv(as_kernel_array(keys), as_kernel_array(values), slots, np.ascontiguousarray(k),
                 np.ascontiguousarray(v))
        self._record(Recorder.store_kv, keys, values, slots, k, v)

    def attention(self, q, keys, values, q_pos, k_pos, scale, window, softcap, sinks=None):
        q, sinks = np.ascontiguousarray(q), self._sinks(q.shape[1], sinks)
        out = attention(q, keys, values, q_pos, k_pos, scale, window, softcap, sinks)
        return self._record(Recorder.attention, q, keys, values, q_pos, [k_pos], [0, len(q)], scale, window, softcap,
                            sinks, out=out)

    def attention_lanes(self, q, keys, values, q_pos, key_positions, starts, scale, window, softcap, sinks=None):
        q, sinks = np.ascontiguousarray(q), self._sinks(q.shape[1], sinks)
        out = few_attention(q, keys, values, q_pos, key_positions, starts, scale, window, softcap, sinks)
        return self._record(Recorder.attention, q, keys, values, q_pos, key_positions, starts, scale, window, softcap,
                            sinks, out=out)

    def _sinks(self, n_head, sinks):
        """sinks, or a sink at MASKED for every head, which takes no weight."""
        if sinks is None:
            sinks = self._no_sinks.get(n_head)
            if sinks is None:
                sinks = self._no_sinks[n_head] = self.load_vector(np.full(n_head, MASKED))
        return sinks

    @staticmethod
    def _gate_operands(gate, up):
        """gate and up as contiguous arrays: one token's are already (column slices of a stacked
        product's single row), several tokens' are copied, so that a gate compiles to the same
        loop for one token as for several and a token's values are bit for bit the same either way
        (a strided array gets a kernel of its own, which LLVM vectorizes and fuses differently)."""
        return np.ascontiguousarray(gate), np.ascontiguousarray(up)

    def silu_mul(self, gate, up):
        gate, up = self._gate_operands(gate, up)
        ops.silu_mul(gate, up)
        self._record(Recorder.silu_mul, gate, up)
        return gate

    def gelu_mul(self, gate, up):
        gate, up = self._gate_operands(gate, up)
        ops.gelu_mul(gate, up)
        self._record(Recorder.gelu_mul, gate, up)
        return gate

    def clamped_swiglu(self, gate, up, alpha, limit):
        gate, up = self._gate_operands(gate, up)
        ops.clamped_swiglu(gate, up, np.float32(alpha), np.float32(limit))
        self._record(Recorder.clamped_swiglu, gate, up, alpha, limit)
        return gate
