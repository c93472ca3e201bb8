"""What this machine's CPU is, as benchmark figures name it: the model and the vector features
that decide which kernels run (AVX2, AVX-512, VNNI, AMX); and which 8-bit dot-product
instructions the kernels are compiled with."""
from __future__ import annotations

import os
import platform
from functools import lru_cache

import numba
from llvmlite import binding

# /proc/cpuinfo flag -> the name figures print
_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
             ("amx_tile", "AMX"))


@lru_cache(maxsize=1)
def _cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@lru_cache(maxsize=1)
def cpu_description() -> str:
    """E.g. 'Intel(R) Xeon(R) Processor (AVX2, AVX-512, AVX512-VNNI, AVX-VNNI, AMX)'."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    features = [name for flag, name in _FEATURES if flag in flags]
    return f"{info.get('model name') or platform.processor() or platform.machine()} ({', '.join(features) or 'no AVX2'})"


@lru_cache(maxsize=1)
def memory_streams() -> int:
    """How many sequential streams each thread of decode's products reads the weights in
    ($GGRUN_STREAMS overrides): AMD's prefetchers follow one sequential stream per thread and
    read far-apart streams slower, while Intel's Xeons read faster with four streams a thread."""
    if os.environ.get("GGRUN_STREAMS", "").isdigit() and int(os.environ["GGRUN_STREAMS"]) > 0:
        return int(os.environ["GGRUN_STREAMS"])
    return 4 if _cpuinfo().get("vendor_id") == "GenuineIntel" else 1


def compiles_for_host() -> bool:
    """Whether Numba compiles for this machine's CPU, not for a NUMBA_CPU_NAME or
    NUMBA_CPU_FEATURES target chosen to make caches portable (or to test a path)."""
    return numba.config.CPU_NAME in (None, "host") and numba.config.CPU_FEATURES is None


@lru_cache(maxsize=1)
def target_features() -> frozenset:
    """The CPU features Numba compiles for: the host's, or those NUMBA_CPU_FEATURES gives when
    NUMBA_CPU_NAME or NUMBA_CPU_FEATURES names another target (portable caches, and the tests of
    each instruction path). LLVM stops the process on an instruction the target lacks, so the
    kernels ask this, never /proc/cpuinfo."""
    if not compiles_for_host():
        return frozenset(f[1:] for f in (numba.config.CPU_FEATURES or "").split(",") if f.startswith("+"))
    return frozenset(name for name, on in binding.get_host_cpu_features().items() if on)


def int8_isa() -> str:
    """The 8-bit dot products the kernels use: "vnni" (vpdpbusd: AVX512-VNNI or AVX-VNNI),
    "avx2" (vpmaddubsw and vpmaddwd) or "generic" (LLVM's choice from plain integer IR)."""
    features = target_features()
    if "avx2" in features and ("avxvnni" in features or {"avx512vnni", "avx512vl"} <= features):
        return "vnni"
    return "avx2" if "avx2" in features else "generic"
