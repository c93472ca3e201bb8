"""Work split over plain Python threads, one per core, for code that releases the GIL.

Prefill's products are BLAS calls (single-threaded, GIL released) after nogil Numba work.
Running them on plain threads, rather than BLAS's own pool, keeps BLAS's threads and Numba's
OpenMP workers from spinning against each other for the same cores.
"""
from concurrent.futures import ThreadPoolExecutor

import numba

_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def in_parallel(work, n: int, max_tile: int = 512) -> None:
    """work(first, last) over spans of range(n) no longer than max_tile, a multiple of the
    thread count of them so that the threads finish together."""
    global _pool, _pool_threads
    threads = numba.get_num_threads()
    if _pool is None or _pool_threads != threads:
        _pool, _pool_threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ggrun"), threads
    n_spans = threads * -(-n // (threads * max_tile))
    size = -(-n // n_spans)
    for future in [_pool.submit(work, first, min(first + size, n)) for first in range(0, n, size)]:
        future.result()
