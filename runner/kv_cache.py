"""Key/value cache: slots allocated once, each slot tagged with the position it holds.

Global-attention layers get one slot per token of the context. With `ring=True` the context never
runs out: the first `pinned` tokens (BOS and the system prompt) stay, and every later token takes
the slot of the oldest unpinned one, so memory is flat and a step after the wrap costs what any
other step costs. Attention masks by the positions in the slots, so slot order does not matter.

RoPE sees each cached key at the position it was written with. To keep every query-key distance
below the context size however long the stream runs, the pinned keys are re-rotated to sit just
before the oldest ring token (`shift`); the model does that rotation, the cache keeps the keys
as first written (`pinned_source`).

A sliding-window layer only ever looks `window` positions back, so it gets window + max_batch
slots used as a ring (slot = position mod capacity) whether or not the global layers ring.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

# Leading tokens pinned when nothing else is (no BOS, no system prompt): attention leans on the
# first token as a sink, and a window that loses it degrades fast (as StreamingLLM observed;
# measured here on SmolLM2 with a 32-slot ring, wrapping batches of an eighth of it: PPL 104 with no
# sink, 41.0 with one, 42.98 for fresh 32-token windows).
SINK_TOKENS = 1


class ContextFullError(Exception):
    """The tokens to add do not fit in the context window."""


@dataclass(frozen=True)
class Batch:
    """One forward pass's tokens and the cache slots they take, per kind of layer (global or
    sliding window): host arrays from the cache, or a backend's device copies of them."""
    ids: object             # (T,) token ids
    positions: object       # (T,) int32
    slots: tuple            # per kind: (T,) int64 slots the tokens are written to
    key_positions: tuple    # per kind: the positions held by the slots attention reads (-1: empty)
    capacities: tuple       # per kind: slots in the cache (a bound for backends that pad key_positions)

    def named_arrays(self):
        """(field name, array or tuple of arrays) of every array field."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "capacities"]

    def arrays(self) -> list:
        out = []
        for _, a in self.named_arrays():
            out.extend(a if isinstance(a, tuple) else [a])
        return out

    def replace(self, **changes) -> Batch:
        return replace(self, **changes)


class KVCache:
    def __init__(self, backend, n_ctx: int, layer_windows: list[int], n_kv_head: int, key_dim: int,
                 value_dim: int, max_batch: int, ring: bool = False, kv_type: str = "f32"):
        self.backend = backend
        self.n_ctx, self.max_batch, self.ring = n_ctx, max_batch, ring
        self.windowed = [w > 0 for w in layer_windows]
        self.capacity = [min(n_ctx, w + max_batch) if w else n_ctx for w in layer_windows]
        # in the backend's layout: the cache only hands them to its store_kv and attention
        self.keys, self.values = map(list, zip(*[backend.new_kv(n_kv_head, key_dim, value_dim, cap, kv_type)
                                                 for cap in self.capacity]))
        # each layer's kind: ("window" or "global", capacity); layers of one kind share a position table
        kinds = [("window", cap) if w else ("global", cap) for w, cap in zip(self.windowed, self.capacity)]
        self.kind_list = sorted(set(kinds))
        self.kind_index = [self.kind_list.index(kind) for kind in kinds]  # layer -> its kind in a Batch
        self.positions = {kind: np.full(kind[1], -1, dtype=np.int32) for kind in self.kind_list}
        self.used = 0       # tokens stored so far, which is also the next token's position
        self.pinned = 0     # leading tokens the ring never overwrites
        self.evicted = 0    # tokens the ring has overwritten in the global layers
        self._pinned: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> pinned keys, values as written
        self.replays: dict = {}  # a backend's recorded steps over this cache's buffers (CUDA graphs, CPU programs)

    def _slots(self, kind, positions: np.ndarray) -> np.ndarray:
        if kind[0] == "window":
            return positions % kind[1]
        p = self.pinned
        return np.where(positions < p, positions, p + (positions - p) % (self.n_ctx - p))

    @property
    def ring_size(self) -> int:
        return self.n_ctx - self.pinned

    @property
    def shift(self) -> int:
        """How far the pinned keys' positions move forward so that they precede the ring's oldest token."""
        return max(0, self.used - self.n_ctx) if self.ring else 0

    def batch_limit(self, n_tokens: int) -> int:
        """The most tokens one forward pass may add now. A batch that wraps the ring overwrites keys
        that its own first queries could still have seen, so a wrapping batch is at most half the
        ring: each query still sees at least half of it, as after llama.cpp's context shift (which
        drops half the context at once). Measured on SmolLM2 streaming a text through a ring of
        256: 321 tok/s at PPL 28.47 against 166 tok/s at 27.81 with batches of an eighth."""
        if self.ring and self.used + n_tokens > self.n_ctx:
            return max(1, min(self.max_batch, self.ring_size // 2))
        return self.max_batch

    def reserve(self, tokens) -> Batch:
        """Claim slots for the next tokens: the batch that a forward pass over them runs."""
        n_tokens = len(tokens)
        if not self.ring and self.used + n_tokens > self.n_ctx:
            raise ContextFullError(f"{self.used} + {n_tokens} tokens exceed the context of {self.n_ctx}")
        if n_tokens > min(self.max_batch, self.ring_size):
            raise ValueError(f"a batch of {n_tokens} tokens exceeds what the cache takes at once")
        positions = np.arange(self.used, self.used + n_tokens, dtype=np.int32)
        slots = []
        for kind in self.kind_list:
            table = self.positions[kind]
            slots.append(self._slots(kind, positions).astype(np.int64))
            if kind[0] == "global":
                self.evicted += int(np.count_nonzero(table[slots[-1]] >= 0))
            table[slots[-1]] = positions
        self.used += n_tokens
        # filled slots come first: attention reads only those
        key_positions = tuple(self.positions[kind][:min(self.used, kind[1])] for kind in self.kind_list)
        return Batch(np.asarray(tokens, dtype=np.int64), positions, tuple(slots), key_positions,
                     tuple(kind[1] for kind in self.kind_list))

    def store(self, layer: int, k, v, batch: Batch) -> tuple:
        """Write k, v (tokens, kv heads, dim) of the batch into its slots; return the layer's
        keys and values and the positions their slots hold."""
        kind = self.kind_index[layer]
        self.backend.store_kv(self.keys[layer], self.values[layer], batch.slots[kind], k, v)
        return self.keys[layer], self.values[layer], batch.key_positions[kind]

    def pin(self) -> None:
        """Keep the tokens stored so far for good (call before the ring first wraps)."""
        if self.used >= self.n_ctx:
            raise ContextFullError("the pinned prefix must leave room in the context")
        self.pinned = self.used
        self._pinned = {i: tuple(map(np.ascontiguousarray,
                                     self.backend.read_kv(self.keys[i], self.values[i], self.pinned)))
                        for i, w in enumerate(self.windowed) if not w}

    def pinned_source(self, layer: int):
        """The pinned keys of a global layer as first written: (tokens, kv heads, dim)."""
        return self.backend.asarray(self._pinned[layer][0].copy())

    def set_pinned_keys(self, layer: int, keys) -> None:
        """Overwrite the pinned keys (tokens, kv heads, dim); their values are written back as they were."""
        slots = np.arange(self.pinned, dtype=np.int64)
        self.backend.store_kv(self.keys[layer], self.values[layer], slots, keys,
                              self.backend.asarray(self._pinned[layer][1]))
