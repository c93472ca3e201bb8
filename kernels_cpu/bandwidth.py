"""The machine's memory read bandwidth, measured the way the decode kernels read weights.

A decode step streams every weight once, so its ceiling is the rate at which the cores can read
a buffer far larger than the caches: each thread reads its part in as many sequential streams as
the products do (cpu_features.memory_streams), and the best of a few passes is kept.
"""
import os
import time

import numpy as np
from numba import njit, prange

from .cpu_features import memory_streams

CHUNK = 64  # int64 values (512 bytes) read from one stream before the next


@njit(cache=True, fastmath=True, inline="always")
def _sum(values):
    """(A loop over a slice: indexing buf itself with computed offsets kept LLVM from vectorizing,
    and the probe then measured the loop's arithmetic rather than the memory.)"""
    total = np.int64(0)
    for i in range(values.shape[0]):
        total += values[i]
    return total


@njit(cache=True, parallel=True)
def _stream_sum(buf, n_parts, streams):
    part = buf.shape[0] // n_parts
    totals = np.zeros(n_parts, dtype=np.int64)
    for p in prange(n_parts):
        first = p * part
        if streams == 1:
            totals[p] = _sum(buf[first:first + part])
            continue
        stream = part // streams
        total = np.int64(0)
        for at in range(0, stream - CHUNK + 1, CHUNK):
            for s in range(streams):
                total += _sum(buf[first + s * stream + at:first + s * stream + at + CHUNK])
        totals[p] = total
    return totals.sum()


def _buffer_bytes() -> int:
    """Four times the last-level cache, at least 512 MiB, at most 2 GiB."""
    try:
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        l3 = 0
    return int(min(max(4 * max(l3, 0), 512 << 20), 2 << 30))


def read_bandwidth(passes: int = 3) -> float:
    """Bytes per second read by all threads, best of `passes` after one warm-up pass."""
    import numba
    buf = np.ones(_buffer_bytes() // 8, dtype=np.int64)
    n_parts, streams = numba.get_num_threads(), memory_streams()
    _stream_sum(buf, n_parts, streams)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        _stream_sum(buf, n_parts, streams)
        best = min(best, time.perf_counter() - start)
    return buf.nbytes / best
