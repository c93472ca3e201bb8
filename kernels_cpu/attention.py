"""Attention over the KV cache (laid out as kv_layout.py describes, in any of its element types).

Every slot carries the position it holds, and the mask is computed from positions, never from
slot indices, so any slot order works (the ring of kv_cache.py, sliding windows, the blocks of
kv_pool.py). The sums run over the visible keys in the order of their positions, so a result
does not depend on where the cache keeps them: a sequence's blocks scattered in a pool among
others' compute what the same keys in one run of slots compute, bit for bit.
A few queries (decode) run a Numba kernel; many (prefill) run BLAS products per head.

Attention sinks (gpt-oss): each head's learned logit joins its softmax's denominator, taking a
share of the weight that no value carries. A head without one has a sink at MASKED, whose
exp is exactly 0: the same arithmetic, bit for bit.
"""
import math

import numpy as np
from numba import carray, njit, prange

from .intrinsics import cache_product, exp_f32, max_f32, pointer_at, rows_tag
from .kv_layout import KEY_TILE, as_kernel_array, head_dims, key_columns, value_rows
from .threads import in_parallel

# Up to this many queries, the Numba kernel; beyond, BLAS, over chunks of this many queries.
FEW_QUERIES = 8
QUERY_CHUNK = 128


# Masked scores; finite, because fastmath code may assume there are no infinities.
MASKED = np.float32(-1e30)
# The first position of a chunk that sees none (it sorts last).
NO_POSITION = np.int32(2**31 - 1)
# Slots per job of the decode kernel: enough jobs for every core even with one KV head.
SLOT_CHUNK = 256


@njit(cache=True, nogil=True, inline="always")
def _visible(kp, qp, window):
    """Whether a query at position qp sees the slot holding position kp: 0 <= kp <= qp and, with
    a sliding window, qp - kp < window; empty slots hold -1. (Bitwise &, |: no branches in loops.)"""
    return (kp >= 0) & (kp <= qp) & ((window == 0) | (qp - kp < window))


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _exp_scores(row, qp, k_pos, window, softcap):
    """Scores of one query at position qp -> exp(score - max), in place; returns (max, sum).

    Invisible slots (see _visible) get 0.
    """
    if softcap > 0:  # (a loop of its own: libm's tanh would keep the masking loop from vectorizing)
        for s in range(row.shape[0]):
            row[s] = softcap * math.tanh(row[s] / softcap)
    best = MASKED
    for s in range(row.shape[0]):
        v = row[s] if _visible(k_pos[s], qp, window) else MASKED
        row[s] = v
        best = max_f32(best, v)
    total = np.float32(0.0)
    if best == MASKED:  # nothing visible
        row[:] = 0.0
        return best, total
    for s in range(row.shape[0]):
        e = exp_f32(row[s] - best)
        row[s] = e
        total += e
    return best, total


@njit(cache=True, nogil=True, fastmath=True)
def softmax_visible(scores, q_pos, k_pos, window, softcap, sink):
    """Attention weights from scores (queries, slots), in place, beside the head's sink logit;
    see _exp_scores for the mask."""
    for t in range(scores.shape[0]):
        best, total = _exp_scores(scores[t], q_pos[t], k_pos, window, softcap)
        top = max_f32(best, sink)
        shift = exp_f32(best - top)
        total = total * shift + exp_f32(sink - top)
        if total > 0:
            scores[t] *= shift / total


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _attention_job(job, t, kv, first, q, keys, values, q_pos, k_pos, scale, window, softcap, maxima, sums,
                   partial, firsts, group_tag):
    """Job `job` of attention_lanes: token t's query heads of KV head kv over the chunk of slots
    from `first` (none past its lane's len(k_pos)): the chunk's softmax max and sum and its
    weighted values, from register-blocked cache_product calls, and the first position it sees
    (the order in which chunks are added up)."""
    _, n_head, key_dim = q.shape
    n_slots = k_pos.shape[0]
    group = n_head // keys.shape[0]
    # only the span of the chunk's slots that the query can see (a sliding window's ring holds
    # up to twice the window; the slots outside it cost as much as the ones inside)
    qp, begin, end, lowest = q_pos[t], SLOT_CHUNK, 0, NO_POSITION
    for s in range(first, min(first + SLOT_CHUNK, n_slots)):
        # (selects rather than an if, so that the loop vectorizes: at long contexts a branch here
        # is a large share of the job)
        seen = _visible(k_pos[s], qp, window)
        begin = min(begin, s - first if seen else SLOT_CHUNK)
        end = max(end, s - first + 1 if seen else 0)
        lowest = min(lowest, k_pos[s] if seen else NO_POSITION)
    firsts[job] = lowest
    if end <= begin:
        for g in range(group):
            maxima[job, g], sums[job, g] = MASKED, 0.0
        return
    begin -= begin % KEY_TILE  # (key tiles are read whole; the slots before begin score 0)
    first, n = first + begin, end - begin
    queries = np.empty((group, key_dim), dtype=np.float32)
    for g in range(group):
        for i in range(key_dim):
            queries[g, i] = q[t, kv * group + g, i] * scale
    scores = np.empty((group, n), dtype=np.float32)
    cache_product(keys, kv, 0, first, queries, scores, group_tag)
    for g in range(group):
        maxima[job, g], sums[job, g] = _exp_scores(scores[g], qp, k_pos[first:first + n], window, softcap)
    cache_product(values, kv, first, 0, scores, partial[job], group_tag)


@njit(cache=True, parallel=True, fastmath=True)
def attention_lanes(q, keys, values, q_pos, key_inputs, first_input, input_stride, starts, scale, window, softcap,
                    sinks, out, group_tag):
    """Grouped-query attention of a few queries q (T, heads, dim) of several sequences (lanes)
    over one cache, keys and values as new_cache lays them out: lane j's queries, rows
    starts[j]..starts[j + 1] - 1, over the slots whose positions (int32) row first_input + j *
    input_stride of key_inputs (address, count) holds, with each head's sink logit (sinks, MASKED
    where none); group_tag is intrinsics.rows_tag(heads per KV head). One sequence is one lane.

    Jobs are (token, kv head, chunk of slots), all the lanes' in one parallel loop (a loop per
    lane cost each decode step of several sequences a start of the threads per layer and lane), run
    on all threads even for a short context (a second, serial driver for those would save nothing
    measurable and would add as much compile time as this one); each chunk keeps its own softmax
    max and sum, rescaled when the chunks are added up. Callers guarantee that each lane's count
    is at most the cache's slots and that starts ends at T."""
    n_kv = keys.shape[0]
    n_lanes = starts.shape[0] - 1
    most = 0
    for j in range(n_lanes):
        most = max(most, key_inputs[first_input + j * input_stride, 1])
    n_chunks = (most + SLOT_CHUNK - 1) // SLOT_CHUNK  # (a lane with fewer slots leaves its last jobs empty)
    n_jobs = q.shape[0] * n_kv * n_chunks
    group = q.shape[1] // n_kv
    maxima = np.empty((n_jobs, group), dtype=np.float32)
    sums = np.empty((n_jobs, group), dtype=np.float32)
    partial = np.empty((n_jobs, group, out.shape[2]), dtype=np.float32)
    firsts = np.empty(n_jobs, dtype=np.int32)
    # (no array expressions outside the loop, nor in the functions inlined here: in a parallel
    # function each becomes a parallel region of its own, whose start costs more than a small
    # model's whole call)
    for job in prange(n_jobs):
        t = job // (n_kv * n_chunks)
        lane = 0
        while starts[lane + 1] <= t:
            lane += 1
        row = first_input + lane * input_stride
        k_pos = carray(pointer_at(key_inputs[row, 0], np.int32), (key_inputs[row, 1],))
        _attention_job(job, t, job // n_chunks % n_kv, job % n_chunks * SLOT_CHUNK, q, keys, values, q_pos, k_pos,
                       scale, window, softcap, maxima, sums, partial, firsts, group_tag)
    _combine_chunks(maxima, sums, partial, firsts, sinks, n_kv, n_chunks, out)


@njit(cache=True, fastmath=True, inline="always")
def _combine_chunks(maxima, sums, partial, firsts, sinks, n_kv, n_chunks, out):
    """out[t, h] from the per-chunk softmax maxima, sums and weighted values of attention_few,
    and the head's sink: the chunks added up in the order of the first positions they see."""
    n_tokens, n_head, value_dim = out.shape
    group = n_head // n_kv
    order = np.empty(n_chunks, dtype=np.int64)
    for t in range(n_tokens):
        for h in range(n_head):
            kv, g = h // group, h % group
            first_job = (t * n_kv + kv) * n_chunks
            _chunk_order(firsts[first_job:first_job + n_chunks], order)
            best = sinks[h]
            for job in range(first_job, first_job + n_chunks):
                best = max(best, maxima[job, g])
            total = exp_f32(sinks[h] - best)
            row = out[t, h]
            for i in range(value_dim):  # (a loop: see attention_few's note on array expressions)
                row[i] = 0.0
            for c in range(n_chunks):
                job = first_job + order[c]
                if sums[job, g] > 0:
                    rescale = exp_f32(maxima[job, g] - best)
                    total += sums[job, g] * rescale
                    for i in range(value_dim):
                        row[i] += partial[job, g, i] * rescale
            inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            for i in range(value_dim):
                row[i] *= inv


@njit(cache=True, inline="always")
def _chunk_order(firsts, order):
    """order: the chunks by the first position each sees (an insertion sort: there are few, and
    they come in order already where a cache keeps its tokens in order)."""
    for c in range(firsts.shape[0]):
        order[c] = c
        j = c
        while j > 0 and firsts[order[j - 1]] > firsts[c]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = c


def few_attention(q, keys, values, q_pos, key_positions: list, starts: list, scale, window, softcap, sinks):
    """Attention of a few queries q (T, heads, dim) at positions q_pos, lane by lane
    (attention_lanes): lane j's queries, rows starts[j]..starts[j + 1] - 1, over the cache's
    slots whose positions key_positions[j] holds; returns (T, heads, value dim)."""
    key_positions = [np.ascontiguousarray(k, dtype=np.int32) for k in key_positions]
    if len(starts) != len(key_positions) + 1 or starts[0] != 0 or starts[-1] != q.shape[0] \
            or any(len(k) > values.shape[1] for k in key_positions):  # (the kernel reads them unchecked)
        raise ValueError("lanes of attention that do not match the queries or the cache")
    out = np.empty((*q.shape[:2], head_dims(keys, values)[1]), dtype=np.float32)
    table = np.array([(k.ctypes.data, len(k)) for k in key_positions], dtype=np.int64).reshape(-1, 2)
    attention_lanes(q, as_kernel_array(keys), as_kernel_array(values), q_pos, table, 0, 1,
                    np.asarray(starts, dtype=np.int32), np.float32(scale), int(window), np.float32(softcap), sinks, out,
                    rows_tag(q.shape[1] // keys.shape[0]))
    return out


def attention(q, keys, values, q_pos, k_pos, scale, window, softcap, sinks):
    """Attention of queries q (T, heads, dim) at positions q_pos over the cache's first len(k_pos)
    slots, beside each head's sink logit (sinks (heads,), MASKED where none); returns (T, heads,
    value dim)."""
    n_tokens, n_head, _ = q.shape
    if n_tokens <= FEW_QUERIES:
        return few_attention(q, keys, values, q_pos, [k_pos], [0, n_tokens], scale, window, softcap, sinks)
    out = np.empty((n_tokens, n_head, head_dims(keys, values)[1]), dtype=np.float32)
    args = (np.float32(scale), int(window), np.float32(softcap))
    group = n_head // keys.shape[0]
    chunks = [(a, min(a + QUERY_CHUNK, n_tokens)) for a in range(0, n_tokens, QUERY_CHUNK)]
    spans = [_visible_slots(q_pos[a:b], k_pos, args[1]) for a, b in chunks]
    # only the key tiles from the first slot seen to the last are converted (a pool holds other
    # sequences' blocks too), with the spans counted from there
    bounds = [(s.start, s.stop) if isinstance(s, slice) else (int(s.min()), int(s.max()) + 1) for s in spans]
    bounds = [(a, b) for a, b in bounds if b > a] or [(0, 0)]
    base, end = min(a for a, _ in bounds), max(b for _, b in bounds)
    base -= base % KEY_TILE
    spans = [slice(s.start - base, s.stop - base) if isinstance(s, slice) else s - base for s in spans]
    k_pos = k_pos[base:end]

    def heads(first, last):
        converted = {}  # a KV head's keys and values as float32, once for all its query heads
        for h in range(first, last):
            kv = h // group
            if kv not in converted:
                converted[kv] = (key_columns(keys[kv:kv + 1, base // KEY_TILE:], end - base)[0],
                                 value_rows(values[kv:kv + 1, base:], end - base)[0])
            k, v = converted[kv]
            for (a, b), slots in zip(chunks, spans):
                scores = (q[a:b, h, :] * args[0]) @ k[:, slots]
                softmax_visible(scores, q_pos[a:b], k_pos[slots], args[1], args[2], sinks[h])
                np.matmul(scores, v[slots], out=out[a:b, h, :])
    in_parallel(heads, n_head)
    return out


def _visible_slots(q_pos, k_pos, window):
    """The slots that any of these queries may see (causal masking: a chunk of early queries
    skips the later keys, about half the work of a prompt), in the order of their positions: a
    slice where they lie so in one run of slots, else their indices."""
    q_min, q_max = q_pos.min(), q_pos.max()
    seen = (k_pos >= 0) & (k_pos <= q_max)
    if window:
        seen &= q_min - k_pos < window
    slots = np.flatnonzero(seen)
    if not slots.size:
        return slice(0, 0)
    begin, end = int(slots[0]), int(slots[-1]) + 1
    if end - begin == slots.size and (slots.size == 1 or (np.diff(k_pos[begin:end]) > 0).all()):
        return slice(begin, end)
    return slots[np.argsort(k_pos[slots], kind="stable")]
