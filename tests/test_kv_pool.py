"""The paged KV cache (runner/engine/kv_pool.py): block tables, shared prefixes, reference counts, LRU
eviction, reservations and copy-on-write, on a backend of plain arrays whose slots hold the
token written there (blocks of 4 slots), and on real models, whose logits through the pool
equal those through a KVCache."""
from __future__ import annotations

import numpy as np
import pytest

from runner.engine.kv_cache import ContextFullError
from runner.engine.kv_pool import KVPool, PoolExhausted, SequenceCache


class TokenRows:
    """A backend whose cache layer is one number a slot: what store_kv writes, the token."""
    kv_block = 4

    def new_kv(self, n_kv, key_dim, value_dim, slots, kv_type):
        return np.full(slots, -1, dtype=np.int64), np.full(slots, -1, dtype=np.int64)

    def export_kv(self, keys, values, slots):
        return keys[slots].copy(), values[slots].copy()

    def import_kv(self, keys, values, slots, key_rows, value_rows):
        keys[slots], values[slots] = key_rows, value_rows

    def store_kv(self, keys, values, slots, k, v):
        keys[slots], values[slots] = k, v


def new_pool(blocks: int) -> KVPool:
    return KVPool(TokenRows(), blocks * TokenRows.kv_block, [(1, 1, 1)], "f32")


def begin(pool, ids, needed=None, reuse=True) -> tuple[SequenceCache, int]:
    cache = SequenceCache(pool, n_ctx=64, max_batch=16)
    reused = cache.start(ids, reuse, needed or len(ids) + 4)
    assert reused is not None
    cache.feed(ids[reused:])
    return cache, reused


def feed(cache: SequenceCache, tokens) -> None:
    batch = cache.reserve(tokens)
    cache.store(0, np.asarray(tokens), np.asarray(tokens), batch)


SequenceCache.feed = feed  # (what a forward pass does to the cache: the tokens' keys into their slots)


def seen(cache: SequenceCache) -> list[int]:
    """The tokens attention sees through the cache, by position."""
    batch = cache.reserve([0])  # (a probe: the batch a pass would read with)
    keys, _, positions = cache.read(0, batch)
    slots = np.flatnonzero((positions >= 0) & (positions < cache.used - 1))
    tokens = keys[slots[np.argsort(positions[slots])]].tolist()
    cache.truncate(cache.used - 1)
    return tokens


def test_sequences_see_their_own_tokens_alone():
    pool = new_pool(8)
    a, _ = begin(pool, [1, 2, 3])
    b, _ = begin(pool, [9, 8, 7, 6, 5])
    for t in range(10, 16):  # (interleaved: their blocks alternate in the pool)
        a.feed([t])
        b.feed([t + 100])
    assert seen(a) == [1, 2, 3, *range(10, 16)]
    assert seen(b) == [9, 8, 7, 6, 5, *range(110, 116)]
    assert not set(a.table) & set(b.table) and pool.blocks_used == len(a.table) + len(b.table)


def test_full_blocks_are_shared_and_only_what_follows_is_prefilled():
    pool = new_pool(8)
    prompt = list(range(1, 11))  # (two full blocks and two tokens)
    a, _ = begin(pool, prompt)
    c, reused = begin(pool, prompt[:8] + [50, 51])  # (while a runs: its full blocks, shared)
    assert reused == 8 and c.table[:2] == a.table[:2] and [pool.refs[b] for b in a.table[:2]] == [2, 2]
    assert seen(c) == prompt[:8] + [50, 51]
    a.release()
    c.release()
    assert pool.blocks_used == 0 and len(pool.cached) == 4  # (nobody holds them; all kept for reuse)
    b, reused = begin(pool, prompt + [60])  # (the next turn: a's partial block taken over)
    assert reused == 10 and seen(b) == prompt + [60]
    d, reused = begin(pool, prompt[:9] + [70], reuse=False)
    assert reused == 0 and seen(d) == prompt[:9] + [70]


def test_a_kept_partial_block_is_copied_for_a_successor_that_leaves_it():
    pool = new_pool(8)
    prompt = list(range(1, 11))
    a, _ = begin(pool, prompt)
    kept = a.table[-1]
    a.release()
    b, reused = begin(pool, prompt[:9] + [80, 81])  # (one token of its two)
    assert reused == 9 and kept not in b.table and seen(b) == prompt[:9] + [80, 81]
    c, reused = begin(pool, prompt + [90])  # (the whole of it: taken over)
    assert reused == 10 and kept in c.table and seen(c) == prompt + [90]


def test_cached_blocks_go_least_recently_used_first():
    pool = new_pool(4)
    old, _ = begin(pool, [1, 2, 3, 4, 5], needed=8)
    old.release()
    new, _ = begin(pool, [6, 7, 8, 9, 10], needed=8)
    new.release()
    assert len(pool.cached) == 4 and not pool.free
    assert begin(pool, [11, 12, 13, 14, 15, 16], needed=8)[1] == 0  # (it takes two blocks: the oldest)
    assert pool.lookup(0, [1, 2, 3, 4]) is None and pool.lookup(0, [6, 7, 8, 9]) is not None


def test_admission_waits_for_a_reservation_and_truncation_gives_blocks_back():
    pool = new_pool(4)
    a, _ = begin(pool, [1, 2, 3], needed=12)  # (three blocks reserved, one taken)
    waiting = SequenceCache(pool, n_ctx=64, max_batch=16)
    assert waiting.start([5, 6, 7], True, 8) is None and not waiting.table  # (one block free: it needs two)
    a.feed(list(range(4, 13)))  # (all three)
    with pytest.raises(ContextFullError):
        SequenceCache(pool, n_ctx=4, max_batch=16).reserve([1, 2, 3, 4, 5])
    a.truncate(5)
    assert len(a.table) == 2 and a.budget == 1 and seen(a) == [1, 2, 3, 4, 5]
    a.release()
    assert waiting.start([5, 6, 7], True, 8) == 0
    over = SequenceCache(pool, n_ctx=64, max_batch=16)
    assert over.start([1], True, 8) == 0
    over.feed(list(range(1, 9)))
    with pytest.raises(PoolExhausted):  # (beyond its reservation, where the rest are promised)
        over.feed([9])


def test_truncating_into_a_shared_block_copies_it():
    pool = new_pool(8)
    a, _ = begin(pool, list(range(1, 9)))  # (two full blocks, both registered)
    b, reused = begin(pool, list(range(1, 9)) + [20])
    assert reused == 8 and pool.refs[a.table[1]] == 2
    shared = a.table[1]
    a.truncate(6)  # (a rejected draft, say: a writes positions 6 and on anew)
    assert a.table[1] != shared and pool.refs[shared] == 1
    a.feed([30, 31, 32])
    assert seen(a) == [1, 2, 3, 4, 5, 6, 30, 31, 32] and seen(b) == list(range(1, 9)) + [20]


def test_a_failed_sequence_leaves_no_blocks_to_find():
    pool = new_pool(4)
    a, _ = begin(pool, list(range(1, 10)))
    a.release(keep=False)
    assert pool.blocks_used == 0 and not pool.cached and begin(pool, list(range(1, 10)))[1] == 0


@pytest.mark.parametrize("model,kv_type", [("smollm", "q8_0"), ("gemma", "f32")])
def test_a_pool_computes_what_a_cache_computes(model, kv_type, smollm_path, gemma_path):
    """Two sequences through one pool (their blocks interleaved), each against the same tokens
    through a KVCache of its own in the same passes: the same logits, bit for bit where the
    cache keeps its tokens in one run of slots. Gemma 3's sliding-window layers attend over the
    pool with the window as a mask, past the window's length (a KVCache keeps those in a ring of
    slots, whose chunks add up otherwise)."""
    from runner.engine.load import LoadOptions, load_model
    lm = load_model(smollm_path if model == "smollm" else gemma_path, LoadOptions(kv_type=kv_type))
    m = lm.model
    pool = m.new_kv_pool(4 * 1024)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 2000, n).tolist() for n in (700, 300)]
    worst = 0.0
    assert any(m.new_cache(1024).windowed) == (model == "gemma")
    views, plain = [m.sequence_cache(pool, 1024) for _ in prompts], [m.new_cache(1024) for _ in prompts]
    for view, ids in zip(views, prompts):
        assert view.start(ids, True, 1024) == 0
    for start in range(0, 700, 128):  # (the prompts' chunks, the two sequences in turn)
        for ids, view, cache in zip(prompts, views, plain):
            if start < len(ids):
                chunk = ids[start:start + 128]
                worst = max(worst, np.abs(m.forward(chunk, view) - m.forward(chunk, cache)).max())
    for step in range(3):
        got = m.forward_lanes([[5 + step], [7 + step]], views)
        want = [m.forward([5 + step], plain[0]), m.forward([7 + step], plain[1])]
        worst = max(worst, np.abs(got - np.stack(want)).max())
    for step in range(3):  # (one sequence's steps through the pool and through a cache, by turns)
        worst = max(worst, np.abs(m.forward([9 + step], views[0]) - m.forward([9 + step], plain[0])).max())
    assert worst == 0 if model == "smollm" else worst < 1e-3, worst


def test_a_copy_that_does_not_fit_gives_way_to_a_prefill():
    """A kept partial block whose start a successor would copy, where the pool has no block for
    the copy beside it: the successor prefills instead of waiting for ever."""
    pool = new_pool(2)
    a, _ = begin(pool, [1, 2, 3], needed=8)
    a.release()
    assert begin(pool, [1, 2, 9, 9], needed=8)[1] == 0
