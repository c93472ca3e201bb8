"""What this machine's CPU is, as benchmark figures name it: the model and the vector features
that decide which kernels run (AVX2, AVX-512, VNNI, AMX)."""
from __future__ import annotations

import platform
from functools import lru_cache

# /proc/cpuinfo flag -> the name figures print
_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
             ("amx_tile", "AMX"))


@lru_cache(maxsize=1)
def cpu_description() -> str:
    """E.g. 'Intel(R) Xeon(R) Processor (AVX2, AVX-512, AVX512-VNNI, AVX-VNNI, AMX)'."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    features = [name for flag, name in _FEATURES if flag in flags]
    return f"{model} ({', '.join(features) or 'no AVX2'})"
