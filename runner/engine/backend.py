"""The operations model code may ask of a compute backend, and how a backend is chosen.

Model files call only these methods, so the same model runs on kernels_cpu (Numba) or
kernels_gpu (torch). Activations are (tokens, features) float32 arrays of the backend's kind.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol


class BackendError(Exception):
    """The device asked for is absent, or the model does not fit in it."""


class Backend(Protocol):
    name: str
    label: str  # name, and the units prefill's products run on where they vary (bench reports it)
    decode_products: str  # how decode's products round the activations, and on which instructions
    threads: int
    few_tokens: int             # the most tokens a forward pass runs through decode's kernels (more: prefill's)
    supported_types: frozenset  # GGML tensor types load_matrix takes
    kv_types: tuple             # KV cache element types new_kv makes ("f32", "f16", "q8_0")
    kv_block: int               # slots of a paged cache's block: attention skips as many at once (kv_pool.py)
    replays_states: bool        # whether run replays a hybrid's pass over another sequence's recurrent states
    replays_lanes: bool         # whether run replays a pass of several sequences' lanes (Batch.lanes)

    def free_memory(self) -> int | None:
        """Bytes the device can still allocate; None for the host's memory (not checked)."""

    def run(self, compute, batch, memory=None, owner=None, all_logits: bool = False) -> Any:
        """compute(batch with its arrays on the device). `memory` marks a pass of at most few_tokens
        tokens that computes the same every time up to the batch's values, which the backend may
        record once per shape and replay: memory is what holds the buffers of the pass's cache (per
        layer `keys` and `values` lists, its `kv_type` and a hybrid's recurrent `states`: a KVCache,
        or a SequenceCache's pool, or a hybrid's sequence's view of it),
        owner the model that computes it (two models on one backend never share a recording), and
        all_logits whether it returns the logits of every token or of the last. The backend keeps
        its recordings itself, each for as long as what it is kept by lives: the CPU a step program
        per owner, kv type, all_logits and batch shape (its tokens, each lane's, its arrays), which
        binds the buffers of whichever memory it replays over; CUDA graphs per memory, which replay over the buffers they were
        recorded on. Without memory the pass runs eagerly."""

    def upload(self, batch) -> Any:
        """The batch with its arrays on the device (run does it for the pass's own batch)."""

    def to_numpy(self, x) -> Any: ...
    def concat(self, xs) -> Any:
        """Arrays of rows one after another (the lanes of a pass, lane by lane)."""
    def softcap(self, x, cap: float) -> Any:
        """cap * tanh(x / cap)."""

    def load_matrix(self, qtype, raw, k: int) -> Any:
        """A weight matrix from raw GGUF rows (N, bytes per row) holding k weights each."""

    def load_table(self, qtype, raw, k: int) -> Any:
        """load_matrix's, for a matrix that is only looked up by rows (embed), never multiplied:
        an untied token embedding, Gemma 4's per-layer embeddings."""

    def load_experts(self, qtype, raw, k: int, experts: int) -> Any:
        """A mixture's expert matrices from raw GGUF rows (experts * N, bytes per row): expert e
        is rows e*N..(e+1)*N, as GGML lays out a [k, N, experts] tensor."""

    def load_vector(self, values) -> Any: ...
    def asarray(self, values) -> Any: ...
    def matmul(self, w, x) -> Any: ...
    def matmuls(self, ws, x) -> list:
        """[matmul(w, x) for w in ws], in one pass where the backend can."""
    def split(self, x, widths) -> list:
        """x (T, sum(widths))'s columns in consecutive pieces of these widths (a fused matrix's
        projections)."""
    def route(self, logits, k: int, gating: str, norm: bool, scale: float, selection_bias=None) -> tuple:
        """Each token's k most probable experts of router logits (T, experts): ids (T, k), best
        first, and weights (T, k), their probabilities ("softmax" over the experts or "sigmoid"
        each; "softmax_weight": chosen by the logits, the softmax over the chosen), renormalized
        to sum to 1 if norm, times scale. selection_bias (experts,), where given, is added to the
        probabilities for choosing the experts only (DeepSeek-V3's exp_probs_b). Recorded, not
        read by the host."""

    def expert_matmuls(self, ws, x, ids) -> list:
        """For each expert matrix w: (T * k, N), slot t * k + j the product of expert ids[t, j]
        with x's row t (x of T rows) or x's row t * k + j (x of T * k rows)."""

    def expert_rows(self, table, ids) -> Any:
        """(T * k, n): slot t * k + j's row of table (experts, n), that of expert ids[t, j]."""

    def expert_combine(self, y, weights) -> Any:
        """(T, n): sum over j of weights[t, j] * y[t * k + j]."""

    def sigmoid_gate(self, x, g) -> Any:
        """x * sigmoid(g), g (T, 1)."""

    def embed(self, w, ids) -> Any: ...
    def rms_norm(self, x, weight, eps: float) -> Any: ...
    def rope(self, x, positions, n_rot: int, base: float, pos_scale: float, neox: bool, freq_factors,
             magnitude: float = 1.0) -> None: ...
    def new_state(self, shape) -> Any:
        """A zeroed float32 array of a recurrent layer's state (recurrent_state.py)."""

    def read_state(self, state) -> Any:
        """A host copy of a state array."""

    def write_state(self, state, values) -> None:
        """Host values (of the state's shape) into a state array."""

    def unary(self, x, kind: str) -> Any:
        """silu(x), sigmoid(x), softplus(x) (x itself above 20, as ggml's) or relu(x)^2, elementwise, by kind."""

    def delta_rule(self, q, k, v, decay, beta, state, grouped: bool = False) -> Any:
        """The gated delta rule, token after token: for value head h (over key head h % key heads,
        or h // (value heads / key heads) where grouped: each key head's value heads together),
        S = exp(decay[t, h]) S, then S += k (beta[t, h] (v - S^T k))^T, out[t, h] = S^T q; q, k (T,
        key heads, d_k), v and out (T, value heads, d_v), decay and beta (T, value heads), the state
        S (value heads, d_k, d_v) float32, updated in place."""

    def ssm_scan(self, x, dt, b, c, a, d, state) -> Any:
        """Mamba2's selective scan, token after token: for head h (of group h // (heads / groups)),
        S = exp(dt[t, h] a[h]) S + (x[t, h] dt[t, h]) B[t, g]^T, out[t, h] = S C[t, g] + d[h] x[t, h];
        x and out (T, heads, head_dim), dt (T, heads) after its softplus, B and C (T, groups, d_state),
        a and d (heads,), the state S (heads, head_dim, d_state) float32, updated in place."""

    def short_conv(self, x, kernel, state) -> Any:
        """A causal depthwise convolution of x (T, channels) over time: out[t, c] = sum over j of
        kernel[c, j] * (state then x)[t + j, c], kernel (channels, K), state (K - 1, channels) the
        inputs before x, which it leaves holding the last K - 1 inputs."""

    def read_bandwidth(self) -> float:
        """Bytes per second the device reads from its memory: the ceiling of a decode step."""

    def new_kv(self, n_kv: int, key_dim: int, value_dim: int, slots: int, kv_type: str) -> tuple:
        """Zeroed (keys, values) of one layer's cache, `slots` slots of one of kv_types, laid out as
        the backend's store_kv and attention take them."""

    def read_kv(self, keys, values, n: int) -> tuple:
        """Slots 0..n-1 of a cache as host float32 (n, kv heads, dim) keys and values."""

    def export_kv(self, keys, values, slots) -> tuple:
        """The slots (a host int64 array) exactly as stored, as host arrays (kv heads, len(slots),
        width) of the cache's element type: one layout on every backend (a q8_0 row: its int8, then
        its blocks' float16 scales as byte pairs), which snapshots keep."""

    def import_kv(self, keys, values, slots, key_rows, value_rows) -> None:
        """export_kv's arrays back into the slots."""

    def store_kv(self, keys, values, slots, k, v) -> None:
        """Token t's k[t] and v[t] (kv heads, dim) into slot slots[t] of keys and values."""

    def attention(self, q, keys, values, q_pos, k_pos, scale: float, window: int, softcap: float,
                  sinks=None) -> Any:
        """Causal grouped-query attention of q (T, heads, dim) over cache slots at positions k_pos;
        sinks (heads,), where given, are logits that join each head's softmax without a value."""

    def attention_lanes(self, q, keys, values, q_pos, key_positions: list, starts: list, scale: float, window: int,
                        softcap: float, sinks=None) -> Any:
        """attention of several sequences' few queries over one cache in one call: sequence j's,
        rows starts[j]..starts[j + 1] - 1 of q, over slots at positions key_positions[j]."""

    def silu_mul(self, gate, up) -> Any: ...
    def gelu_mul(self, gate, up) -> Any: ...
    def clamped_swiglu(self, gate, up, alpha: float, limit: float) -> Any:
        """silu-like gate with gpt-oss's clamps: min(g, limit) * sigmoid(alpha * min(g, limit)) *
        (clamp(up, -limit, limit) + 1)."""


DEVICES = ("auto", "cpu", "cuda", "torch-cpu")


def _nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded, known without importing torch (which takes a second
    of every CPU user's start-up)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.name == "nt"


def resolve_device(device: str) -> str:
    """"auto" is CUDA when torch is installed and sees a GPU, else the Numba CPU backend."""
    if device != "auto":
        return device
    if not _nvidia_driver_present() or importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_backend(device: str = "cpu", threads: int | None = None, precise: bool = False) -> Backend:
    """The backend for a device: "cpu" (Numba), "cuda" (torch on the GPU), "torch-cpu" (the torch
    kernels on the CPU, as the tests run them) or "auto". precise: the CPU's decode products take
    16-bit activations instead of 8-bit ones, and CUDA's prefill products multiply in float32
    instead of TF32 (its decode products are float32 either way)."""
    device = resolve_device(device)
    if device == "cpu":
        from kernels_cpu.backend import CpuBackend
        return CpuBackend(threads, precise)
    if device not in DEVICES:
        raise BackendError(f"unknown device {device!r} (available: {', '.join(DEVICES)})")
    if importlib.util.find_spec("torch") is None:
        raise BackendError(f"--device {device} needs torch: pip install 'ggrun[gpu]'")
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise BackendError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__})")
    from kernels_gpu.backend import TorchBackend
    return TorchBackend("cuda" if device == "cuda" else "cpu", threads, precise=precise)
