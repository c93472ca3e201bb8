"""runner.backend.Backend on the CPU: Numba kernels over numpy arrays."""
from __future__ import annotations

import os

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from . import ops
from .attention import as_kernel_array, attention, cached_rows, new_cache
from .bandwidth import read_bandwidth
from .blocks import SUPPORTED_TYPES
from .matmul import load_matrix, matmuls


class CpuBackend:
    name = "cpu"
    supported_types = SUPPORTED_TYPES

    def __init__(self, threads: int | None = None):
        self.threads = max(1, min(threads or os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.threads)
        # Numba's OpenMP workers spin between parallel regions; a multi-threaded BLAS running
        # beside them (prefill tiles) then fights them for the cores and runs ~10x slower.
        threadpool_limits(1, user_api="blas")
        self._rope_tables: dict = {}

    def free_memory(self):
        return None

    def run(self, compute, batch, replays=None):
        return compute(batch)

    def to_numpy(self, x):
        return x

    def softcap(self, x, cap):
        return np.tanh(x / np.float32(cap)) * np.float32(cap)

    def load_matrix(self, qtype, raw, k):
        return load_matrix(qtype, raw, k)

    def load_vector(self, values):
        return np.ascontiguousarray(values, dtype=np.float32)

    def asarray(self, values):
        return np.ascontiguousarray(values)

    def matmul(self, w, x):
        return w.matmul(x)

    def matmuls(self, ws, x):
        return matmuls(ws, x)

    def embed(self, w, ids):
        return w.rows(ids)

    def rms_norm(self, x, weight, eps):
        out = np.empty_like(x)
        ops.rms_norm(x, weight, np.float32(eps), out)
        return out

    def rope(self, x, positions, n_rot, base, pos_scale, neox, freq_factors):
        ops.rope(x, *self._rope_table(positions, n_rot, base, pos_scale, freq_factors), neox)

    def _rope_table(self, positions, n_rot, base, pos_scale, freq_factors):
        """cos/sin tables, kept for the few most recent position sets: every layer of a forward
        pass rotates its queries and keys at the same positions, with one or two RoPE bases."""
        key = (positions.tobytes(), n_rot, base, pos_scale, None if freq_factors is None else freq_factors.tobytes())
        table = self._rope_tables.pop(key, None)
        if table is None:
            table = ops.rope_table(positions, n_rot, base, pos_scale, freq_factors)
        self._rope_tables[key] = table
        while len(self._rope_tables) > 4:
            del self._rope_tables[next(iter(self._rope_tables))]
        return table

    def read_bandwidth(self):
        return read_bandwidth()

    def new_kv(self, n_kv, key_dim, value_dim, slots, kv_type):
        return new_cache(n_kv, key_dim, value_dim, slots, {"f16": np.float16, "f32": np.float32}[kv_type])

    def read_kv(self, keys, values, n):
        return cached_rows(keys, values, n)

    def store_kv(self, keys, values, slots, k, v):
        ops.store_kv(as_kernel_array(keys), as_kernel_array(values), slots, np.ascontiguousarray(k),
                     np.ascontiguousarray(v))

    def attention(self, q, keys, values, q_pos, k_pos, scale, window, softcap):
        return attention(np.ascontiguousarray(q), keys, values, q_pos, k_pos, scale, window, softcap)

    def silu_mul(self, gate, up):
        ops.silu_mul(gate, up)
        return gate

    def gelu_mul(self, gate, up):
        ops.gelu_mul(gate, up)
        return gate
