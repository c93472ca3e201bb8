"""The memory arithmetic of local inference, from the file alone: weights, KV cache (and a hybrid's
recurrent state), what fits."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from gguf_io import GGUFFile, ModelParams

# bytes per cached key/value element; q8_0 stores 32 int8 values and one f16 scale per block
KV_ELEMENT_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def parse_size(text: str) -> int:
    """'8G', '512MiB', '1.5GB', '1000000' -> bytes (K/M/G/T are powers of 1024, as RAM is sold)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (examples: 8G, 512M, 1.5GiB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


class MemoryFitError(Exception):
    """What was asked for needs more memory than is free; the message says how much, and what fits."""


def available_host_memory() -> int | None:
    """Bytes the host can still give this process without swapping (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class MemoryFit:
    params: ModelParams
    weight_bytes_by_type: dict[str, int]
    kv_type: str
    state_bytes: int = 0  # a sequence's recurrent state (a hybrid's), whatever its context

    @classmethod
    def of(cls, f: GGUFFile, params: ModelParams, kv_type: str, state_bytes: int = 0) -> MemoryFit:
        by_type = Counter()
        for t in f.tensors.values():
            by_type[t.type.name] += t.nbytes  # the blocks' scales and mins included
        return cls(params, dict(by_type), kv_type, state_bytes)

    @property
    def layer_windows(self) -> dict[int, int]:
        """The window of each layer with a cache of its own (0: global), by layer: not a hybrid's
        recurrent layers, nor its blocks without attention (Nemotron-H's feed-forward ones)."""
        p = self.params
        return {i: p.layer_windows[i] for i in range(p.n_layer_kv or p.n_layer) if p.layer_kv_heads(i)}

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_type.values())

    def _token_bytes(self, i: int) -> float:
        """Keys and values of one token in layer i: (key size + value size) x KV heads x element size."""
        p = self.params
        return (p.layer_head_dim(i) + p.layer_value_dim(i)) * p.layer_kv_heads(i) * KV_ELEMENT_BYTES[self.kv_type]

    def kv_bytes_per_token_per_layer(self) -> float:
        """One token's keys and values in a cached layer (on average where layers differ; 0 where no
        layer attends: plain Mamba2)."""
        return sum(map(self._token_bytes, self.layer_windows)) / max(1, len(self.layer_windows))

    def kv_bytes_per_token(self) -> float:
        """What one more token of context costs once every sliding window is full (global layers only)."""
        return sum(self._token_bytes(i) for i, w in self.layer_windows.items() if w == 0)

    def kv_bytes(self, n_ctx: int, users: int = 1) -> float:
        return users * sum(self._token_bytes(i) * (min(n_ctx, w) if w else n_ctx)
                           for i, w in self.layer_windows.items())

    def cache_bytes(self, n_ctx: int, users: int = 1, states: int | None = None) -> float:
        """What the users' sequences hold: KV caches and recurrent states (states of them: one per
        user where None; a server's pool keeps checkpoints too)."""
        return self.kv_bytes(n_ctx, users) + (users if states is None else states) * self.state_bytes

    def total_bytes(self, n_ctx: int, users: int = 1, states: int | None = None) -> float:
        return self.weight_bytes + self.cache_bytes(n_ctx, users, states)

    def max_context(self, memory: int, users: int = 1, weights: bool = True, states: int | None = None) -> int:
        """The longest context (up to the trained length) whose weights (where weights) + KV cache
        and recurrent states fit in memory."""
        lo, hi = 0, self.params.context_length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cache_bytes(mid, users, states) + (self.weight_bytes if weights else 0) <= memory:
                lo = mid
            else:
                hi = mid - 1
        return lo
