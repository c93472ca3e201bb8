"""Key/value cache: slots allocated once, each slot tagged with the position it holds.

Global-attention layers get one slot per token of the context. With `ring=True` the context never
runs out: the first `pinned` tokens (BOS and the system prompt) stay, and every later token takes
the slot of the oldest unpinned one, so memory is flat and a step after the wrap costs what any
other step costs. Attention masks by the positions in the slots, so slot order does not matter.

RoPE sees each cached key at the position it was written with. To keep every query-key distance
below the context size however long the stream runs, the pinned keys are re-rotated to sit just
before the oldest ring token (`shift`): `move_pinned` does it before each pass, with each layer's
rotation, which the model passes, from the keys as first written.

`truncate(n)` forgets every token from position n on (speculative decoding's rejected drafts);
inside a wrapped ring, with `undo_overwrites` set, it also puts back what the last pass's
forgotten tokens overwrote, so the cache holds what it held before them;
`snapshot` / `restore` copy the whole state out and back, and `save` / `load` keep it on disk, in
one layout on every backend (kv_state.py).

A sliding-window layer only ever looks `window` positions back, so it gets window + max_batch
slots used as a ring (slot = position mod capacity) whether or not the global layers ring.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from .kv_state import KVState, check_fits
from .recurrent_state import RecurrentState

# Leading tokens pinned when nothing else is (no BOS, no system prompt): attention leans on the
# first token as a sink, and a window that loses it degrades fast (as StreamingLLM observed, and
# as SmolLM2 does through a small ring: docs/design.md).
SINK_TOKENS = 1

# Tokens of context when none is asked for, where the model trained on more: the cache stays small
# (llama.cpp's tools default to a few thousand too).
DEFAULT_CONTEXT = 4096
# The smallest context: a prompt, a reply and a ring's pinned start need a few tokens each.
MIN_CONTEXT = 16


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
    lanes: tuple = ()       # a pass over several sequences (Decoder.forward_lanes): each one's own batch

    def named_arrays(self):
        """(field name, array or tuple of arrays) of every array field of the pass's own."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in ("capacities", "lanes")]

    def arrays(self) -> list:
        """Every array of the pass, its lanes' after its own, in an order fixed by its shape."""
        out = []
        for _, a in self.named_arrays():
            out.extend(a if isinstance(a, tuple) else [a])
        for lane in self.lanes:
            out.extend(lane.arrays())
        return out

    def replace(self, **changes) -> Batch:
        return replace(self, **changes)


class KVCache:
    def __init__(self, backend, n_ctx: int, layer_windows: list[int], head_shapes: list[tuple[int, int, int]],
                 max_batch: int, kv_type: str, ring: bool = False, recurrent: RecurrentState | None = None):
        """One cache layer per entry of layer_windows, with its (KV heads, key size, value size)
        from head_shapes; a hybrid model's recurrent layers' state beside them (recurrent)."""
        self.backend, self.recurrent = backend, recurrent
        self.n_ctx, self.max_batch, self.ring = n_ctx, max_batch, ring
        self.kv_type, self.head_shapes = kv_type, [tuple(map(int, s)) for s in head_shapes]
        self.windowed = [w > 0 for w in layer_windows]
        self.capacity = [min(n_ctx, w + max_batch) if w else n_ctx for w in layer_windows]
        # in the backend's layout: the cache only hands them to its store_kv and attention (none in a
        # model without attention layers: plain Mamba2)
        pairs = [backend.new_kv(*shape, cap, kv_type) for shape, cap in zip(self.head_shapes, self.capacity)]
        self.keys, self.values = [k for k, _ in pairs], [v for _, v in pairs]
        # each layer's kind: ("window" or "global", capacity); layers of one kind share a position table
        kinds = [("window", cap) if w else ("global", cap) for w, cap in zip(self.windowed, self.capacity)]
        self.kind_list = sorted(set(kinds))
        self.kind_index = [self.kind_list.index(kind) for kind in kinds]  # layer -> its kind in a Batch
        self.positions = {kind: np.full(kind[1], -1, dtype=np.int32) for kind in self.kind_list}
        self.used = 0       # tokens stored so far, which is also the next token's position
        self.pinned = 0     # leading tokens the ring never overwrites
        self.evicted = 0    # tokens the ring has overwritten in the global layers
        self._pinned: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> pinned keys, values as written
        self._rotated_to: dict[int, int] = {}  # layer -> the shift its pinned keys are rotated to now
        # Keep what each pass overwrites in a wrapped ring, for truncate to put back (speculative
        # decoding sets it). Of the last pass: per global kind, the slots it took from older tokens
        # and their positions; per layer, those slots' rows as they were.
        self.undo_overwrites = False
        self._overwritten_slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._overwritten_rows: dict[int, tuple] = {}

    @property
    def memory(self) -> KVCache:
        """What holds the buffers that passes over this cache read and write (Backend.run)."""
        return self

    @property
    def states(self) -> list:
        """The recurrent states a pass updates (a hybrid's), in a fixed order."""
        return [] if self.recurrent is None else list(self.recurrent.arrays.values())

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
        drops half the context at once), and larger batches stream a long prompt faster at a small
        cost in perplexity (docs/design.md)."""
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
        self._overwritten_slots, self._overwritten_rows = {}, {}
        for k, kind in enumerate(self.kind_list):
            table = self.positions[kind]
            slots.append(self._slots(kind, positions).astype(np.int64))
            if kind[0] == "global":
                taken = slots[-1][table[slots[-1]] >= 0]
                self.evicted += len(taken)
                if self.undo_overwrites and len(taken):
                    self._overwritten_slots[k] = (taken, table[taken].copy())
            table[slots[-1]] = positions
        if self.recurrent is not None:
            self.recurrent.begin(self.used, n_tokens)
        self.used += n_tokens
        # filled slots come first: attention reads only those
        key_positions = tuple(self.positions[kind][:min(self.used, kind[1])] for kind in self.kind_list)
        return Batch(np.asarray(tokens, dtype=np.int64), positions, tuple(slots), key_positions,
                     tuple(kind[1] for kind in self.kind_list))

    def store(self, layer: int, k, v, batch: Batch) -> tuple:
        """Write k, v (tokens, kv heads, dim) of the batch into its slots; return the layer's
        keys and values and the positions their slots hold."""
        kind = self.kind_index[layer]
        if kind in self._overwritten_slots:
            self._overwritten_rows[layer] = self.backend.export_kv(self.keys[layer], self.values[layer],
                                                                   self._overwritten_slots[kind][0])
        self.backend.store_kv(self.keys[layer], self.values[layer], batch.slots[kind], k, v)
        return self.read(layer, batch)

    def read(self, layer: int, batch: Batch) -> tuple:
        """The layer's keys and values and the positions their slots hold, as store left them
        (for a layer that attends over another's cache: Gemma 4's shared-KV layers)."""
        return self.keys[layer], self.values[layer], batch.key_positions[self.kind_index[layer]]

    @property
    def rotates_pinned(self) -> bool:
        """Whether the pinned keys lag behind the ring's shift (move_pinned brings them up)."""
        return any(at != self.shift for at in self._rotated_to.values())

    def move_pinned(self, rotation) -> None:
        """Rotate each layer's pinned keys to sit just before the ring's oldest token, as a step
        of its own before a forward pass (rotation(layer) is the layer's RoPE, in place), so that
        the pass itself stays one a backend may record and replay."""
        for layer, at in self._rotated_to.items():
            if at != self.shift:
                self._write_pinned(layer, self.shift, rotation(layer))

    def _write_pinned(self, layer: int, shift: int, rotate=None) -> None:
        """The pinned keys as first written (rotated at 0..P-1) back into their slots, moved to
        shift..shift+P-1 by rotate (none needed for shift 0)."""
        keys, values = self._pinned[layer]
        keys = self.backend.asarray(keys.copy())
        if shift:
            rotate(keys, np.full(self.pinned, shift, dtype=np.int32))
        self.backend.store_kv(self.keys[layer], self.values[layer], np.arange(self.pinned, dtype=np.int64), keys,
                              self.backend.asarray(values))
        self._rotated_to[layer] = shift

    def pin(self) -> None:
        """Keep the tokens stored so far for good (call before the ring first wraps)."""
        if self.used >= self.n_ctx:
            raise ContextFullError("the pinned prefix must leave room in the context")
        self.pinned = self.used
        self._pinned = {i: tuple(map(np.ascontiguousarray,
                                     self.backend.read_kv(self.keys[i], self.values[i], self.pinned)))
                        for i, w in enumerate(self.windowed) if not w}
        self._rotated_to = {i: 0 for i in self._pinned}

    def truncation_keeps(self, n: int) -> bool:
        """Whether truncate(n) leaves a cache that continues as one that stopped at n: each
        sliding-window layer, which keeps only window + max_batch slots, still holds the window
        before position n (the tokens past n may have overwritten it), and the recurrent state
        can go back to n."""
        if self.recurrent is not None and not self.recurrent.can_return_to(n):
            return False
        for kind in self.kind_list:
            if kind[0] == "window" and kind[1] < self.n_ctx:
                needed = np.arange(max(0, n - (kind[1] - self.max_batch)), n)
                if not np.isin(needed, self.positions[kind]).all():
                    return False
        return True

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on, as if they had never been added; the next token
        takes position n. Inside a wrapped ring, what they overwrote is put back if they came in
        the last pass and undo_overwrites is set; otherwise it stays lost: the context then holds
        fewer tokens until it fills again. Into the pinned prefix, the prefix shrinks."""
        if not 0 <= n <= self.used:
            raise ValueError(f"cannot truncate a cache of {self.used} tokens to {n}")
        if self.recurrent is not None:  # (first: it refuses what it cannot do, before anything changes)
            self.recurrent.return_to(n)
        self._put_back_overwritten(n)
        if n < self.pinned:
            for i in self._pinned:  # back as first written, then shortened
                self._write_pinned(i, 0)
            self.pinned = n
            self._pinned = {i: (k[:n].copy(), v[:n].copy()) for i, (k, v) in self._pinned.items()} if n else {}
            self._rotated_to = {i: 0 for i in self._pinned}
        for table in self.positions.values():
            table[table >= n] = -1
        self.used = n

    def _put_back_overwritten(self, n: int) -> None:
        """The slots that the last pass's tokens from position n on took from older tokens, back
        as they were (where that pass ran through store: a replayed step does not)."""
        by_kind, rows = self._overwritten_slots, self._overwritten_rows
        self._overwritten_slots, self._overwritten_rows = {}, {}
        layers = [i for i, k in enumerate(self.kind_index) if k in by_kind]
        if not by_kind or n >= self.used or any(i not in rows for i in layers):
            return
        for k, (slots, old) in by_kind.items():
            table = self.positions[self.kind_list[k]]
            back = (table[slots] >= n) & (old < n)
            for i in (i for i in layers if self.kind_index[i] == k):
                key_rows, value_rows = rows[i]
                self.backend.import_kv(self.keys[i], self.values[i], slots[back], key_rows[:, back],
                                       value_rows[:, back])
            table[slots[back]] = old[back]
            self.evicted -= int(np.count_nonzero(back))

    def shape(self) -> dict:
        """What a saved state must have been made by to fit this cache."""
        return {"layers": len(self.keys), "n_ctx": self.n_ctx, "ring": self.ring, "kv_type": self.kv_type,
                "head_shapes": [list(shape) for shape in self.head_shapes],
                "capacities": list(self.capacity), "kinds": [list(kind) for kind in self.kind_list],
                "max_batch": self.max_batch, **({} if self.recurrent is None else {"recurrent": self.recurrent.shape()})}

    def snapshot(self, note: dict | None = None) -> KVState:
        """The whole state, copied out (to restore later, or save to disk). note: the caller's."""
        rows = [self.backend.export_kv(k, v, np.arange(min(self.used, cap)))
                for k, v, cap in zip(self.keys, self.values, self.capacity)]
        return KVState(shape=self.shape(), used=self.used, pinned=self.pinned, evicted=self.evicted,
                       positions=[self.positions[kind].copy() for kind in self.kind_list],
                       keys=[k for k, _ in rows], values=[v for _, v in rows],
                       pinned_keys={i: k.copy() for i, (k, _) in self._pinned.items()},
                       pinned_values={i: v.copy() for i, (_, v) in self._pinned.items()},
                       rotated_to=dict(self._rotated_to), note=dict(note or {}),
                       recurrent={} if self.recurrent is None else self.recurrent.export())

    def restore(self, state: KVState) -> None:
        """Back to a snapshot of a cache of the same shape; a state that does not fit raises
        KVStateError and changes nothing. Recorded steps stay valid: the buffers are the same."""
        check_fits(state, self)
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            self.backend.import_kv(keys, values, np.arange(state.keys[i].shape[1]), state.keys[i],
                                   state.values[i])
        for kind, table in zip(self.kind_list, state.positions):
            self.positions[kind][:] = table
        self.used, self.pinned, self.evicted = state.used, state.pinned, state.evicted
        self._overwritten_slots, self._overwritten_rows = {}, {}
        self._pinned = {i: (state.pinned_keys[i].copy(), state.pinned_values[i].copy()) for i in state.pinned_keys}
        self._rotated_to = dict(state.rotated_to)
        if self.recurrent is not None:
            self.recurrent.load(state.recurrent, state.used)
