"""The operations model code may ask of a compute backend, and how a backend is chosen.

Model files call only these methods, so the same model runs on kernels_cpu (Numba) or
kernels_gpu (torch). Activations are (tokens, features) float32 arrays of the backend's kind.
"""
from __future__ import annotations

from typing import Any, Protocol


class Backend(Protocol):
    name: str
    threads: int

    def load_matrix(self, qtype, raw, k: int) -> Any:
        """A weight matrix from raw GGUF rows (N, bytes per row) holding k weights each."""

    def load_vector(self, values) -> Any: ...
    def asarray(self, values) -> Any: ...
    def matmul(self, w, x) -> Any: ...
    def matmuls(self, ws, x) -> list:
        """[matmul(w, x) for w in ws], in one pass where the backend can."""
    def embed(self, w, ids) -> Any: ...
    def rms_norm(self, x, weight, eps: float) -> Any: ...
    def rope(self, x, positions, n_rot: int, base: float, pos_scale: float, neox: bool, freq_factors) -> None: ...
    def read_bandwidth(self) -> float:
        """Bytes per second the device reads from its memory: the ceiling of a decode step."""

    def kv_zeros(self, shape, kv_type: str) -> Any:
        """A zeroed KV-cache buffer of precision kv_type: "f16" or "f32"."""

    def store_kv(self, keys, values, slots, k, v) -> None:
        """Token t's k[t] into keys[:, :, slots[t]] (kv heads, dim, slots) and v[t] into
        values[:, slots[t]] (kv heads, slots, dim)."""

    def attention(self, q, keys, values, q_pos, k_pos, scale: float, window: int, softcap: float) -> Any:
        """Causal grouped-query attention of q (T, heads, dim) over cache slots at positions k_pos."""

    def silu_mul(self, gate, up) -> Any: ...
    def gelu_mul(self, gate, up) -> Any: ...


def make_backend(device: str = "cpu", threads: int | None = None) -> Backend:
    if device == "cpu":
        from kernels_cpu.backend import CpuBackend
        return CpuBackend(threads)
    raise ValueError(f"unknown device {device!r} (available: cpu)")
