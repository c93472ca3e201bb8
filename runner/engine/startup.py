"""Where the time before the first generated token goes (`ggrun run --timings`)."""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere), interpreter start-up included."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupTimes:
    """Stage -> seconds, in order; the first stage is what ran before `start` was called."""
    stages: dict[str, float] = field(default_factory=dict)
    _last: float = 0.0

    def start(self, stage: str) -> None:
        self.stages[stage] = process_age() or 0.0
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages[stage] = now - self._last
        self._last = now

    def line(self) -> str:
        parts = " · ".join(f"{name} {seconds:.3f} s" for name, seconds in self.stages.items())
        return f"startup: {parts} · first token at {sum(self.stages.values()):.3f} s"


@contextmanager
def paused_gc(pause: bool = True):
    """Python's cyclic garbage collector off inside the block (when pause), as it was after."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
