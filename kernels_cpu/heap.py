"""Keeping freed memory in the process for the next array of its size.

Prefill allocates and frees arrays of megabytes for every product (outputs, activations, their
bands), and glibc's malloc hands such blocks back to the system when they are freed (blocks over
its mmap threshold are unmapped, and free memory at the top of a heap is trimmed), so the next
array of that size takes a page fault on every 4 KiB of it again: about a tenth of a prefill's
time. llama.cpp plans its compute buffers once instead; a Python runner gets the same from
malloc's two settings.
"""
import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# glibc's largest mmap threshold on 64-bit systems: larger blocks (a big vocabulary's logits, the
# KV cache) keep mappings of their own and go back to the system when freed
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30  # free memory a heap keeps at its top before giving it back


def keep_freed_memory() -> bool:
    """Ask malloc to keep freed blocks below MMAP_THRESHOLD in its heaps for reuse; False where
    the C library has no mallopt (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
