"""kernels_cpu.heap: the arrays that prefill frees come back without page faults."""
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# One prefill's arrays, as float32 counts, for 128 tokens of a 2048-wide model with 5632-wide
# feed-forward layers: activations, products' outputs, their bands; some freed before others.
_ROUND = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from kernels_cpu.heap import keep_freed_memory
    assert keep_freed_memory()
sizes = [128 * 2048, 128 * 5632, 8 * 5632 * 16, 128 * 2048, 2 * 128 * 5632]

def prefill():
    for _ in range(3):
        held = [np.ones(n, np.float32) for n in sizes]
        del held[::2]
        held.append(np.ones(sizes[1], np.float32))
        del held

prefill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
prefill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(heap: str) -> int:
    run = subprocess.run([sys.executable, "-c", _ROUND, heap], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return int(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc's settings are glibc's")
def test_freed_arrays_come_back_without_page_faults():
    """With glibc's defaults, the second prefill's arrays fault on thousands of pages (blocks given
    back to the system when freed); with the heap kept (as the CPU backend asks), on none."""
    assert _page_faults("default") > 1000
    assert _page_faults("keep") < 100
