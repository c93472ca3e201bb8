"""Prefill and decode throughput, measured like llama-bench (warm-up first, then repetitions)."""
from __future__ import annotations

import time

import numpy as np


def _time_prefill(lm, n_prompt: int) -> float:
    tokens = np.random.default_rng(0).integers(0, lm.params.vocab_size, n_prompt).tolist()
    cache = lm.model.new_cache(n_prompt)
    start = time.perf_counter()
    lm.model.forward(tokens, cache)
    return n_prompt / (time.perf_counter() - start)


def time_decode(lm, n_gen: int) -> float:
    cache = lm.model.new_cache(n_gen + 1)
    token = lm.tokenizer.vocab.bos_id if lm.tokenizer.vocab.bos_id >= 0 else 0
    lm.model.forward([token], cache)
    start = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(lm.model.forward([token], cache)))
    return n_gen / (time.perf_counter() - start)


def file_type_name(f) -> str:
    """The quantization mix the file declares (general.file_type), as llama.cpp names it."""
    from gguf import LlamaFileType
    try:
        return LlamaFileType(f.get("general.file_type")).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, TypeError):
        return "?"


def run_bench(lm, n_prompt: int, n_gen: int, repetitions: int) -> list[dict]:
    f = lm.file
    base = {"model": f.path.name, "arch": lm.params.arch, "quant": file_type_name(f), "size_mib": f.size / 2**20,
            "params_m": sum(t.n_elements for t in f.tensors.values()) / 1e6,
            "bits_per_weight": f.bits_per_weight(), "backend": lm.backend.name, "threads": lm.backend.threads}
    rows = []
    for test, n, fn in (("pp", n_prompt, _time_prefill), ("tg", n_gen, time_decode)):
        fn(lm, min(n, 8))  # warm-up: compiles and touches every kernel outside the measurement
        speeds = [fn(lm, n) for _ in range(repetitions)]
        rows.append(dict(base, test=f"{test}{n}", n_tokens=n, repetitions=repetitions,
                         tok_s_mean=float(np.mean(speeds)), tok_s_std=float(np.std(speeds)),
                         tok_s=[float(s) for s in speeds]))
    return rows
