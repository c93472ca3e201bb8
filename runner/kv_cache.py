"""Key/value cache: slots allocated once, each slot tagged with the position it holds.

Global-attention layers get a slot for every position of the context. A sliding-window layer
only ever looks `window` positions back, so it gets window + max_batch slots used as a ring
(slot = position mod capacity): a batch of at most max_batch new tokens then only overwrites
positions that no query of the batch can see.
"""
from __future__ import annotations

import numpy as np


class ContextFullError(Exception):
    """The tokens to add do not fit in the context window."""


class KVCache:
    def __init__(self, backend, n_ctx: int, layer_windows: list[int], n_kv_head: int, key_dim: int,
                 value_dim: int, max_batch: int):
        self.n_ctx, self.max_batch = n_ctx, max_batch
        self.capacity = [n_ctx if w == 0 else min(n_ctx, w + max_batch) for w in layer_windows]
        self.keys = [backend.zeros((n_kv_head, cap, key_dim)) for cap in self.capacity]
        self.values = [backend.zeros((n_kv_head, cap, value_dim)) for cap in self.capacity]
        # one position table per distinct capacity: layers of the same kind share it
        self.positions = {cap: np.full(cap, -1, dtype=np.int32) for cap in set(self.capacity)}
        self.used = 0  # tokens stored so far, which is also the next token's position

    def reserve(self, n_tokens: int) -> np.ndarray:
        """Claim slots for the next n_tokens (at most max_batch); returns their positions."""
        if self.used + n_tokens > self.n_ctx:
            raise ContextFullError(f"{self.used} + {n_tokens} tokens exceed the context of {self.n_ctx}")
        if n_tokens > self.max_batch:
            raise ValueError(f"a batch of {n_tokens} tokens exceeds the cache's max batch {self.max_batch}")
        positions = np.arange(self.used, self.used + n_tokens, dtype=np.int32)
        for cap, table in self.positions.items():
            table[positions % cap] = positions
        self.used += n_tokens
        return positions

    def store(self, layer: int, positions: np.ndarray, k, v) -> tuple:
        """Write k, v (tokens, kv heads, dim) at the positions' slots; return the layer's filled
        keys, values and slot positions."""
        cap = self.capacity[layer]
        slots = positions % cap
        self.keys[layer][:, slots] = k.transpose(1, 0, 2)
        self.values[layer][:, slots] = v.transpose(1, 0, 2)
        n = min(self.used, cap)
        return self.keys[layer][:, :n], self.values[layer][:, :n], self.positions[cap][:n]
