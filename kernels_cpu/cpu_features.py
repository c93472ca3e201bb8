"""What this machine's CPU is, as benchmark figures name it: the model and the vector features
that decide which kernels run (AVX2, AVX-512, VNNI, AMX); and which 8-bit dot-product
instructions the kernels are compiled with."""
from __future__ import annotations

import platform
from functools import lru_cache

import numba
from llvmlite import binding

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
