"""The machine's memory read bandwidth, measured the way the decode kernels read weights.

A decode step streams every weight once, so its ceiling is the rate at which the cores can read
a buffer far larger than the caches. One sequential stream per thread reached ~13 GB/s on the
2-core development machine, four interleaved streams 20-25 GB/s (the products also read rows
from four places at once), so the measurement reads four streams per thread and keeps the best
of a few passes.
"""
import os
import time

import numpy as np
from numba import njit, prange

STREAMS = 4
CHUNK = 64  # int64 values (512 bytes) read from one stream before the next; 4 KiB ran ~35% slower


@njit(cache=True, parallel=True)
def _stream_sum(buf, n_parts):
    part = buf.shape[0] // n_parts
    totals = np.zeros(n_parts, dtype=np.int64)
    for p in prange(n_parts):
        first = p * part
        stream = part // STREAMS
        total = np.int64(0)
        for at in range(0, stream - CHUNK + 1, CHUNK):
            for s in range(STREAMS):
                for i in range(first + s * stream + at, first + s * stream + at + CHUNK):
                    total ^= buf[i]
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
    n_parts = 8 * numba.get_num_threads()
    _stream_sum(buf, n_parts)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        _stream_sum(buf, n_parts)
        best = min(best, time.perf_counter() - start)
    return buf.nbytes / best
