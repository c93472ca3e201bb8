"""Key/value cache: slots allocated once for the whole context, each slot tagged with its position."""
from __future__ import annotations

import numpy as np


class ContextFullError(Exception):
    """The tokens to add do not fit in the context window."""


class KVCache:
    """Keys and values of every layer in (kv heads, slots, head dim) arrays allocated up front.

    Slots fill in order; `positions[s]` is the token position held by slot s (-1 when empty),
    which is all attention needs to apply the causal mask.
    """

    def __init__(self, backend, n_layer: int, n_kv_head: int, n_ctx: int, key_dim: int, value_dim: int):
        self.backend = backend
        self.n_ctx = n_ctx
        self.keys = [backend.zeros((n_kv_head, n_ctx, key_dim)) for _ in range(n_layer)]
        self.values = [backend.zeros((n_kv_head, n_ctx, value_dim)) for _ in range(n_layer)]
        self.positions = np.full(n_ctx, -1, dtype=np.int32)
        self.used = 0

    def reserve(self, n_tokens: int) -> tuple[slice, np.ndarray]:
        """Claim slots for the next n_tokens; returns the slots and the tokens' positions."""
        if self.used + n_tokens > self.n_ctx:
            raise ContextFullError(f"{self.used} + {n_tokens} tokens exceed the context of {self.n_ctx}")
        slots = slice(self.used, self.used + n_tokens)
        positions = np.arange(self.used, self.used + n_tokens, dtype=np.int32)
        self.positions[slots] = positions
        self.used += n_tokens
        return slots, positions

    def store(self, layer: int, slots: slice, k, v) -> tuple:
        """Write k, v (tokens, kv heads, dim) into their slots; return the layer's used cache."""
        self.keys[layer][:, slots] = k.transpose(1, 0, 2)
        self.values[layer][:, slots] = v.transpose(1, 0, 2)
        return self.keys[layer][:, :self.used], self.values[layer][:, :self.used], self.positions[:self.used]

