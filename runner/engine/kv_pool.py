"""A paged KV cache: one pool of fixed-size blocks of slots that every sequence of the batcher
draws from, and each sequence's view of it (SequenceCache), which the model runs against as it
runs against a KVCache.

Memory follows the tokens held. A sequence takes a block when its tokens reach it and gives its
blocks back when it ends; its token at position p sits in slot table[p // B] * B + p % B of every
layer. Attention reads the pool's slots up to the sequence's last block, with the positions of
the sequence's own slots and -1 (empty) everywhere else, so it sees its own tokens alone. B is
the backend's kv_block, the span of slots its attention skips at once where a query sees none
of them: another sequence's block costs a scan of its positions and no arithmetic.

Shared prefixes. A full block is known by its tokens and by its parent block's identity, and is
registered under that key as it fills; a new sequence walks its prompt's full blocks through the
registry and holds every block it finds (reference counts), then prefills only what follows. The
last, partly filled block of a sequence that ends is kept for one successor whose prompt goes on
from it (the next turn of a conversation), which takes it over. Blocks nobody holds stay cached
under their key until their slots are needed, least recently used first.

A hybrid's recurrent state holds no rows per token, so its sequences share a prefix through
checkpoints: the state after a registered block's last token, kept by the pool under that block's
identity (the most recent STATE_CHECKPOINTS of them). A hybrid's passes end where they would cross
a block boundary, so the state there exists; a new sequence resumes from the deepest of its
prompt's blocks that has one, with that state, and prefills what follows.

Admission reserves blocks for a sequence's whole budget (its prompt and most tokens, within the
context), so a running sequence never finds the pool empty: a request that does not fit now
waits, and one that never could is refused. Sliding-window layers keep every token in the pool
(attention masks the window), and every layer shares one block table.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .kv_cache import Batch, ContextFullError
from .recurrent_state import RecurrentState


# a pool's most recurrent-state checkpoints (each as large as a sequence's state), least recently used dropped
STATE_CHECKPOINTS = 16


def states_held(sequences: int) -> int:
    """The most recurrent states (a hybrid's) that a pool's running sequences and its checkpoints hold."""
    return sequences + STATE_CHECKPOINTS


class PoolExhausted(RuntimeError):
    """A sequence needed a block beyond its reservation and the pool had none."""


class KVPool:
    def __init__(self, backend, n_tokens: int, head_shapes: list[tuple[int, int, int]], kv_type: str):
        """Blocks of backend.kv_block slots for at least n_tokens tokens, per layer of head_shapes
        ((KV heads, key size, value size))."""
        self.backend, self.kv_type = backend, kv_type
        self.block = backend.kv_block
        self.n_blocks = max(1, -(-n_tokens // self.block))
        self.n_slots = self.n_blocks * self.block
        pairs = [backend.new_kv(*shape, self.n_slots, kv_type) for shape in head_shapes]  # (none without attention)
        self.keys, self.values = [k for k, _ in pairs], [v for _, v in pairs]
        self.bytes_per_token = sum(a.nbytes + b.nbytes for a, b in zip(self.keys, self.values)) // self.n_slots
        self.refs = [0] * self.n_blocks
        self.free = list(range(self.n_blocks))  # a heap: the lowest block first keeps memory touched low
        self.cached: OrderedDict[int, None] = OrderedDict()  # held by none, kept for their key; oldest first
        self.promised = 0                       # blocks reserved for running sequences, not yet taken
        self._registry: dict[tuple, int] = {}   # (parent's identity, tokens) -> a full block
        self._key: dict[int, tuple] = {}        # registered full block -> its key
        self._identity: dict[int, int] = {}     # registered full block -> its identity (never reused)
        self._partial: dict[int, dict[int, tuple]] = {}  # parent's identity -> {kept partial block: its tokens}
        self._parent: dict[int, int] = {}       # kept partial block -> its parent's identity
        self._next_identity = 1                 # (0: the identity before the first block)
        self.checkpoints: OrderedDict[int, dict] = OrderedDict()  # identity -> a hybrid's state after it

    @property
    def available(self) -> int:
        """Blocks a new reservation may count on: free ones and cached ones."""
        return len(self.free) + len(self.cached) - self.promised

    @property
    def blocks_used(self) -> int:
        return self.n_blocks - len(self.free) - len(self.cached)

    def take(self) -> int:
        """A block for one holder: a free one, else the least recently used cached one."""
        if self.free:
            block = heapq.heappop(self.free)
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self.forget(block)
        else:
            raise PoolExhausted(f"the KV pool's {self.n_blocks} blocks are all in use")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        self.cached.pop(block, None)
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One holder fewer; a block nobody holds stays cached where it has a key, else is free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key or block in self._parent:
                self.cached[block] = None
            else:
                heapq.heappush(self.free, block)

    def forget(self, block: int) -> None:
        """Drop the block's key: nobody finds it again."""
        key = self._key.pop(block, None)
        if key is not None:
            self.checkpoints.pop(self._identity.pop(block), None)
            if self._registry.get(key) == block:
                del self._registry[key]
        parent = self._parent.pop(block, None)
        if parent is not None:
            del self._partial[parent][block]
            if not self._partial[parent]:
                del self._partial[parent]

    def register(self, block: int, parent: int, tokens) -> int:
        """A full block's identity, registering it under (parent, tokens) unless a block of the
        same contents is registered already (then that one's identity: the same chain)."""
        key = (parent, tuple(tokens))
        known = self._registry.get(key)
        if known is not None:
            return self._identity[known]
        identity, self._next_identity = self._next_identity, self._next_identity + 1
        self._registry[key], self._key[block], self._identity[block] = block, key, identity
        return identity

    def keep_partial(self, block: int, parent: int, tokens) -> None:
        """Keep a sequence's last, partly filled block for a successor that goes on from it."""
        self._partial.setdefault(parent, {})[block] = tuple(tokens)
        self._parent[block] = parent

    def keep_state(self, identity: int, arrays: dict) -> None:
        """A hybrid sequence's recurrent state (RecurrentState.export) after the block of this identity."""
        self.checkpoints[identity] = arrays
        self.checkpoints.move_to_end(identity)
        while len(self.checkpoints) > STATE_CHECKPOINTS:
            self.checkpoints.popitem(last=False)

    def state_after(self, identity: int) -> dict | None:
        """The state keep_state kept after that block, if it still has it."""
        if identity in self.checkpoints:
            self.checkpoints.move_to_end(identity)
        return self.checkpoints.get(identity)

    def lookup(self, parent: int, tokens) -> int | None:
        return self._registry.get((parent, tuple(tokens)))

    def identity(self, block: int) -> int:
        return self._identity[block]

    def partial_tokens(self, block: int) -> tuple:
        return self._partial[self._parent[block]][block]

    def partial_after(self, parent: int, tokens: list[int]) -> tuple[int | None, int]:
        """The kept partial block after `parent` that shares the longest start with tokens, and
        how many tokens it shares (held by nobody: a partial block has one holder at most)."""
        best, best_n = None, 0
        for block, held in self._partial.get(parent, {}).items():
            n = common_prefix(held, tokens)
            if n > best_n:
                best, best_n = block, n
        return best, best_n

    def copy_block(self, source: int, target: int, n: int) -> None:
        """The first n slots of one block into another, in every layer."""
        src = np.arange(source * self.block, source * self.block + n)
        dst = np.arange(target * self.block, target * self.block + n)
        for keys, values in zip(self.keys, self.values):
            self.backend.import_kv(keys, values, dst, *self.backend.export_kv(keys, values, src))


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, eq=False)
class SequenceMemory:
    """The pool's buffers with one hybrid sequence's recurrent states (SequenceCache.memory)."""
    keys: list
    values: list
    kv_type: str
    states: list


def lanes_memory(caches) -> KVPool | SequenceMemory | None:
    """What a pass over several sequences' caches replays over (Backend.run's memory): the buffers
    they all share, with each one's recurrent states in lane order; None where they share none."""
    memories = [c.memory for c in caches]
    first = memories[0]
    if any(m.keys is not first.keys for m in memories):
        return None
    states = [s for m in memories for s in getattr(m, "states", ())]
    return SequenceMemory(first.keys, first.values, first.kv_type, states) if states else first


class SequenceCache:
    """One sequence's block table over a KVPool: the cache that Decoder.forward and forward_lanes
    run it against (KVCache's interface, without a ring). Made afresh for each sequence."""
    ring = False
    pinned = 0
    rotates_pinned = False
    undo_overwrites = False  # (nothing is overwritten here: truncate forgets alone)

    def __init__(self, pool: KVPool, n_ctx: int, max_batch: int, recurrent: RecurrentState | None = None):
        """recurrent: a hybrid model's recurrent state of the sequence, beside its blocks."""
        self.pool, self.n_ctx, self.max_batch, self.recurrent = pool, n_ctx, max_batch, recurrent
        if recurrent is not None:
            self._memory = SequenceMemory(pool.keys, pool.values, pool.kv_type, list(recurrent.arrays.values()))
        self.keys, self.values = pool.keys, pool.values
        self.table: list[int] = []   # its blocks, in the order of the positions they hold
        self.tokens: list[int] = []  # the token at each position it holds
        self.chain: list[int] = []   # the identity of each of its full blocks
        self.budget = 0              # blocks reserved for it and not yet taken
        self._key_positions = np.full(pool.n_slots, -1, dtype=np.int32)  # per pool slot, as attention sees them

    @property
    def used(self) -> int:
        return len(self.tokens)

    def start(self, ids: list[int], reuse: bool, tokens_needed: int) -> int | None:
        """Begin with a prompt: with reuse, hold the cached blocks that hold its longest start
        (leaving at least its last token to run) and reserve blocks for tokens_needed tokens in
        all. Returns how many prompt tokens need no prefill, or None, changing nothing, where the
        pool lacks the blocks now."""
        pool, size = self.pool, self.pool.block
        limit = len(ids) - 1 if reuse else 0
        found, parent = [], 0
        while (len(found) + 1) * size <= limit and (block := pool.lookup(parent, ids[len(found) * size:
                                                                                (len(found) + 1) * size])) is not None:
            found.append(block)
            parent = pool.identity(block)
        state = None
        if self.recurrent is not None:  # (back to the deepest block with the state after it; no partial block)
            while found and (state := pool.state_after(pool.identity(found[-1]))) is None:
                found.pop()
            parent, limit = pool.identity(found[-1]) if found else 0, 0
        n = len(found) * size
        partial, shared = pool.partial_after(parent, ids[n:limit]) if limit > n else (None, 0)
        adopt = partial is not None and shared == len(pool.partial_tokens(partial))  # (else a copy of its start)
        # (the blocks it holds leave the cached ones; a partial block copied is held meanwhile)
        room = pool.available - sum(b in pool.cached for b in found)
        need = -(-tokens_needed // size) - len(found) - adopt
        if partial is not None and not adopt and need > room - 1:  # (no room for the copy: prefill those)
            partial, shared = None, 0
        if need > room - (partial is not None):
            return None
        for block in found:
            pool.hold(block)
        self.table, self.chain = found, [pool.identity(b) for b in found]
        pool.promised += need
        self.budget = need
        if partial is not None:
            if adopt:
                pool.forget(partial)
                pool.hold(partial)
                self.table.append(partial)
            else:
                pool.hold(partial)  # (so that taking a block cannot evict it)
                self.table.append(self._take())
                pool.copy_block(partial, self.table[-1], shared)
                pool.drop(partial)
        self.tokens = list(ids[:n + shared])
        positions = np.arange(self.used, dtype=np.int32)
        self._key_positions[self._slots(positions)] = positions
        if state is not None:
            self.recurrent.load(state, self.used)
        return self.used

    def _slots(self, positions: np.ndarray) -> np.ndarray:
        size = self.pool.block
        return np.asarray(self.table, dtype=np.int64)[positions // size] * size + positions % size

    def _take(self) -> int:
        """A block of its reservation (beyond it, one nobody else is promised, if any)."""
        if self.budget > 0:
            self.budget -= 1
            self.pool.promised -= 1
        elif self.pool.available <= 0:
            raise PoolExhausted(f"a sequence outgrew its reservation and the KV pool's {self.pool.n_blocks} "
                                "blocks are all taken or promised")
        return self.pool.take()

    def batch_limit(self, n_tokens: int) -> int:
        """The most of n_tokens the next pass runs: a hybrid's stops at the last block boundary it
        would cross, to checkpoint its state there."""
        size = self.pool.block
        boundary = (self.used + n_tokens - 1) // size * size
        # (not while the state keeps its last pass to go back into: a verify pass stays one)
        if self.recurrent is None or self.recurrent.undo or boundary <= self.used:
            return self.max_batch
        return min(self.max_batch, boundary - self.used)

    def move_pinned(self, rotation) -> None:
        pass

    def truncation_keeps(self, n: int) -> bool:
        return self.recurrent is None or self.recurrent.can_return_to(n)

    @property
    def memory(self) -> KVPool | SequenceMemory:
        """What holds the buffers of the sequence's passes (KVCache.memory): the pool, whose
        sequences share what a backend records over it; with the sequence's own recurrent states."""
        return self.pool if self.recurrent is None else self._memory

    def reserve(self, tokens) -> Batch:
        """Claim slots for the next tokens (blocks as they are reached): the batch that a forward
        pass over them runs."""
        n_tokens, size = len(tokens), self.pool.block
        if self.used + n_tokens > self.n_ctx:
            raise ContextFullError(f"{self.used} + {n_tokens} tokens exceed the context of {self.n_ctx}")
        if n_tokens > self.max_batch:
            raise ValueError(f"a batch of {n_tokens} tokens exceeds what the cache takes at once")
        while len(self.table) * size < self.used + n_tokens:
            self.table.append(self._take())
        if self.recurrent is not None:
            self._checkpoint()
            self.recurrent.begin(self.used, n_tokens)
        positions = np.arange(self.used, self.used + n_tokens, dtype=np.int32)
        slots = self._slots(positions)
        self._key_positions[slots] = positions
        self.tokens.extend(int(t) for t in tokens)
        while (len(self.chain) + 1) * size <= self.used:  # (blocks this batch fills: others may share them now)
            k = len(self.chain)
            self.chain.append(self.pool.register(self.table[k], self.chain[-1] if k else 0,
                                                 self.tokens[k * size:(k + 1) * size]))
        high = (max(self.table) + 1) * size
        # (one kind of slots for every layer; none where no layer attends, as a KVCache of such a model
        # has none: the passes of both are the same recorded step)
        kinds = 1 if self.keys else 0
        return Batch(np.asarray(tokens, dtype=np.int64), positions, (slots,)[:kinds],
                     (self._key_positions[:high],)[:kinds], (self.pool.n_slots,)[:kinds])

    def _checkpoint(self) -> None:
        """Where the tokens so far fill whole blocks, the pool keeps the hybrid's state after the last
        (once per block)."""
        if self.chain and self.used == len(self.chain) * self.pool.block \
                and self.pool.state_after(self.chain[-1]) is None:
            self.pool.keep_state(self.chain[-1], self.recurrent.export())

    def store(self, layer: int, k, v, batch: Batch) -> tuple:
        self.pool.backend.store_kv(self.keys[layer], self.values[layer], batch.slots[0], k, v)
        return self.read(layer, batch)

    def read(self, layer: int, batch: Batch) -> tuple:
        return self.keys[layer], self.values[layer], batch.key_positions[0]

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on (rejected drafts); their whole blocks go back, and
        a registered block it cuts into becomes its own again (a copy, where others hold it)."""
        if not 0 <= n <= self.used:
            raise ValueError(f"cannot truncate a cache of {self.used} tokens to {n}")
        if self.recurrent is not None:  # (first: it refuses what it cannot do, before anything changes)
            self.recurrent.return_to(n)
        pool, size = self.pool, self.pool.block
        self._key_positions[self._slots(np.arange(n, self.used))] = -1
        keep = -(-n // size)
        for block in self.table[keep:]:
            pool.drop(block)
        self.budget += len(self.table) - keep
        pool.promised += len(self.table) - keep
        del self.table[keep:]
        k = n // size
        if len(self.chain) > k and n % size:  # (a full block it keeps part of, to write the rest anew)
            block = self.table[k]
            if pool.refs[block] > 1:
                self.table[k] = self._take()
                pool.copy_block(block, self.table[k], n % size)
                pool.drop(block)
                self._key_positions[block * size:(block + 1) * size] = -1
                positions = np.arange(k * size, n, dtype=np.int32)
                self._key_positions[self._slots(positions)] = positions
            else:
                pool.forget(block)
        del self.chain[k:]
        del self.tokens[n:]

    def release(self, keep: bool = True) -> None:
        """Give its blocks back: with keep, its full blocks stay cached under their keys and its
        last, partial one is kept for a successor; without (a pass that failed may have left them
        half written), the blocks that only it holds are forgotten."""
        pool, size = self.pool, self.pool.block
        if keep and self.recurrent is not None:
            self._checkpoint()
        if keep and self.used % size:
            last = len(self.table) - 1
            pool.keep_partial(self.table[last], self.chain[-1] if self.chain else 0, self.tokens[last * size:])
        for block in self.table:
            if not keep and pool.refs[block] == 1:
                pool.forget(block)
            pool.drop(block)
        pool.promised -= self.budget
        self.table, self.chain, self.tokens, self.budget = [], [], [], 0
