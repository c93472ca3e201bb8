"""runner.engine.backend.Backend in torch: CUDA for users with a card; the CPU device for tests.

Weights stay in their GGUF blocks on the device (matmul.py); every op is plain torch, so the same
code runs on the CPU, where the tests check it against the Numba kernels and gguf.quants. On
CUDA the products of quantized weights run Triton kernels that decode the blocks in registers
(triton_products.py), and one-token steps are replayed from CUDA graphs (step_graph.py).
"""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from gguf_io.quant_types import QUANT_TYPES

from . import kv_layout, ops
from .matmul import Products, upload
from .step_graph import MIN_SLOTS, replay_step


class TorchBackend:
    few_tokens = 1  # (one-token steps run the row dots; more tokens dequantize tiles)
    replays_states = False  # (a CUDA graph replays over the buffers it was recorded on: one sequence's states)
    replays_lanes = False   # (and one sequence's slots)
    supported_types = frozenset(QUANT_TYPES)  # (tests/test_structure.py: DEQUANTIZE covers them)
    kv_types = tuple(kv_layout.ELEMENTS)
    kv_block = MIN_SLOTS  # (its attention reads every slot up to the last: any block size serves)

    def __init__(self, device: str = "cuda", threads: int | None = None, compiled: bool | None = None,
                 graphs: bool | None = None, triton: bool | None = None, precise: bool = False):
        """precise: prefill's products multiply float32 tiles in float32 on CUDA, not in TF32."""
        self.device = torch.device(device)
        self.cuda = cuda = self.device.type == "cuda"
        self.name = self.label = "cuda" if cuda else "torch-cpu"
        self.decode_products = "float activations"  # (the fused dequantize-and-multiply kernels)
        if threads and not cuda:
            torch.set_num_threads(threads)
        self.threads = 1 if cuda else torch.get_num_threads()
        self.products = Products(compiled=cuda if compiled is None else compiled, triton=cuda if triton is None else triton,
                                 tf32=cuda and not precise)
        self.graphs = cuda if graphs is None else graphs
        # memory -> {(tokens, all_logits): {slot buckets: StepGraph}}: a graph replays over the buffers
        # it was recorded on, so it is kept by their holder, weakly, and goes with it
        self.step_graphs = weakref.WeakKeyDictionary()

    def _tensor(self, a, dtype=None):
        """Host arrays (positions, slots) onto the device; device tensors pass through."""
        if isinstance(a, torch.Tensor):
            return a
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(self.device)

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0] if self.cuda else None

    def load_matrix(self, qtype, raw, k):
        return upload(qtype, raw, k, self.device)

    def load_table(self, qtype, raw, k):
        return self.load_matrix(qtype, raw, k)

    def load_experts(self, qtype, raw, k, experts):
        return upload(qtype, raw, k, self.device, experts)

    def load_vector(self, values):
        return self._tensor(values, np.float32)

    def asarray(self, values):
        return self._tensor(values)

    def to_numpy(self, x):
        return x.detach().to("cpu").numpy()

    def upload(self, batch):
        return batch.replace(**{name: tuple(map(self._tensor, a)) if isinstance(a, tuple) else self._tensor(a)
                                for name, a in batch.named_arrays()})

    def run(self, compute, batch, memory=None, owner=None, all_logits=False):
        """compute(batch on the device); a one-token step over `memory` goes through a graph
        recorded over it when graphs are on (owner: memory is one model's already)."""
        if memory is None or not self.graphs:
            return compute(self.upload(batch))
        graphs = self.step_graphs.setdefault(memory, {}).setdefault((len(batch.ids), all_logits), {})
        return replay_step(compute, batch, graphs, self.upload)

    def matmul(self, w, x):
        return self.products.matmul(w, x)

    def matmuls(self, ws, x):
        return [self.products.matmul(w, x) for w in ws]

    def split(self, x, widths):
        return list(torch.split(x, list(widths), dim=1))

    def concat(self, xs):
        return torch.cat(xs)

    def route(self, logits, k, gating, norm, scale, selection_bias=None):
        if selection_bias is not None and tuple(selection_bias.shape) != (logits.shape[1],):
            raise ValueError(f"a selection bias of shape {tuple(selection_bias.shape)} for {logits.shape[1]} experts")
        return ops.route(logits, k, gating, norm, scale, selection_bias)

    def expert_matmuls(self, ws, x, ids):
        return [self.products.expert_matmul(w, x, ids) for w in ws]

    def expert_rows(self, table, ids):
        return table[ids.reshape(-1)]

    def expert_combine(self, y, weights):
        return ops.expert_combine(y, weights)

    def sigmoid_gate(self, x, g):
        return ops.sigmoid_gate(x, g)

    def embed(self, w, ids):
        return w.rows(self._tensor(ids, np.int64))

    def rms_norm(self, x, weight, eps):
        return ops.rms_norm(x, weight, eps)

    def rope(self, x, positions, n_rot, base, pos_scale, neox, freq_factors, magnitude=1.0):
        ops.rope(x, self._tensor(positions), n_rot, base, pos_scale, neox, freq_factors, magnitude)

    def new_kv(self, n_kv, key_dim, value_dim, slots, kv_type):
        return kv_layout.new_kv(n_kv, key_dim, value_dim, slots, kv_type, self.device)

    def read_kv(self, keys, values, n):
        return (self.to_numpy(kv_layout.keys_f32(keys, n).permute(2, 0, 1)),
                self.to_numpy(kv_layout.values_f32(values, n).permute(1, 0, 2)))

    def export_kv(self, keys, values, slots):
        rows = kv_layout.export_rows(keys, values, self._tensor(slots, np.int64))
        return tuple(np.array(self.to_numpy(r)) for r in rows)  # (copies)

    def import_kv(self, keys, values, slots, key_rows, value_rows):
        kv_layout.import_rows(keys, values, self._tensor(slots, np.int64), self._tensor(key_rows),
                              self._tensor(value_rows))

    def store_kv(self, keys, values, slots, k, v):
        kv_layout.store_kv(keys, values, self._tensor(slots, np.int64), k, v)

    def attention(self, q, keys, values, q_pos, k_pos, scale, window, softcap, sinks=None):
        return ops.attention(q, keys, values, self._tensor(q_pos), self._tensor(k_pos), scale, window, softcap, sinks)

    def attention_lanes(self, q, keys, values, q_pos, key_positions, starts, scale, window, softcap, sinks=None):
        # (lane by lane: a lane's keys are a slice of the pool that its own positions mask)
        return torch.cat([self.attention(q[a:b], keys, values, q_pos[a:b], k_pos, scale, window, softcap, sinks)
                          for a, b, k_pos in zip(starts, starts[1:], key_positions)])

    def silu_mul(self, gate, up):
        return ops.silu_mul(gate, up)

    def gelu_mul(self, gate, up):
        return ops.gelu_mul(gate, up)

    def clamped_swiglu(self, gate, up, alpha, limit):
        return ops.clamped_swiglu(gate, up, alpha, limit)

    def softcap(self, x, cap):
        return ops.softcap(x, cap)

    def new_state(self, shape):
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def read_state(self, state):
        return np.array(self.to_numpy(state))  # (a copy)

    def write_state(self, state, values):
        state.copy_(self._tensor(values, np.float32))

    def unary(self, x, kind):
        return ops.UNARY[kind](x)

    def delta_rule(self, q, k, v, decay, beta, state, grouped=False):
        return ops.delta_rule(q, k, v, decay, beta, state, grouped)

    def short_conv(self, x, kernel, state):
        return ops.short_conv(x, kernel, state)

    def ssm_scan(self, x, dt, b, c, a, d, state):
        return ops.ssm_scan(x, dt, b, c, a, d, state)

    def read_bandwidth(self) -> float:
        """Device-to-device copy bandwidth, bytes read plus bytes written per second (as CUDA's
        bandwidthTest counts it), best of a few copies of a buffer far larger than any cache."""
        n = (1 << 30) if self.cuda else (1 << 28)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            self._sync()
            start = time.perf_counter()
            dst.copy_(src)
            self._sync()
            best = min(best, time.perf_counter() - start)
        return 2 * n / best

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
