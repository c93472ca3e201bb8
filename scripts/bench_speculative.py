"""Speculative decoding's speed-up, measured in one process, plain and speculative decoding
alternating (ROUNDS rounds, the best of each kept), greedy, 2 threads unless GGRUN_THREADS says:
  1. SmolLM2-135M as F32 (the registry Q4_1 file widened) with the Q4_1 file as its draft;
  2. the same F32 target with self:Q4_0;
  3. Gemma 3 270M with --lookup 3 on an editing prompt (ggrun's own speculative code and "rewrite
     it with one change");
  4. convert.random_model's 7B shape (Q4_K_M) with a 2-layer draft of the same generator and
     vocabulary: random weights accept next to nothing, so this is what failing speculation costs
     (skipped without GGRUN_BENCH_7B=1: the file is ~4 GB, made once in the cache).
Prints the CPU and its vector features, then each case's decode tok/s, the ratio, the acceptance
and tokens per target pass. Usage: python scripts/bench_speculative.py [N_TOKENS] [ROUNDS]
"""
from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convert.convert import requantize  # noqa: E402
from kernels_cpu.cpu_features import cpu_description, int8_isa  # noqa: E402
from runner.engine import load  # noqa: E402
from runner.generate import GenerationStats, generate  # noqa: E402
from runner.registry import cache_dir, resolve  # noqa: E402
from runner.sampler import Sampler, SamplingOptions  # noqa: E402
from runner.speculative import (PromptLookup, SpeculationStats, check_vocabularies, generate_speculative,  # noqa: E402
                                make_drafter)


def decode_speed(lm, prompt, n, drafter=None):
    """Decode tok/s of n greedy tokens after prompt (and the speculation's stats)."""
    cache, stats, spec = lm.model.new_cache(2048), GenerationStats(), SpeculationStats()
    sampler = Sampler(SamplingOptions(temperature=0))
    if drafter is None:
        tokens = list(generate(lm.model, cache, prompt, sampler, n, (), stats))
    else:
        tokens = list(generate_speculative(lm.model, cache, prompt, sampler, n, (), drafter, 16, 0, stats, spec))
    return stats.decode_tok_s, spec, tokens


def case(name, lm, prompt, n, rounds, new_drafter):
    best_plain = best_spec = 0.0
    for _ in range(rounds):
        plain, _, want = decode_speed(lm, prompt, n)
        fast, spec, got = decode_speed(lm, prompt, n, new_drafter())
        best_plain, best_spec = max(best_plain, plain), max(best_spec, fast)
    same = next((f"differs from token {i}" for i, (a, b) in enumerate(zip(got, want)) if a != b), "identical")
    print(f"{name}: plain {best_plain:.1f} tok/s, speculative {best_spec:.1f} tok/s, ratio {best_spec / best_plain:.2f} "
          f"(acceptance {spec.acceptance:.2f}, {spec.tokens_per_pass:.2f} tokens per pass; greedy text {same})",
          flush=True)


def main(n=128, rounds=2):
    threads = int(os.environ.get("GGRUN_THREADS", "2"))
    print(cpu_description(), int8_isa(), f"{threads} threads", flush=True)
    smollm = Path(resolve("smollm2-135m-instruct"))
    f32 = cache_dir() / "bench" / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        f32.parent.mkdir(parents=True, exist_ok=True)
        requantize(smollm, f32, "F32", progress=False)
    target = load(f32, threads)

    def loader(path):
        return load(Path(resolve(str(path))), threads)
    prompt = target.tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    case("1. F32 target, Q4_1 draft", target, prompt, n, rounds,
         lambda: make_drafter(target, str(smollm), 0, 2048, False, 0.2, loader))
    case("2. F32 target, self:Q4_0", target, prompt, n, rounds,
         lambda: make_drafter(target, "self:Q4_0", 0, 2048, False, 0.2, loader))
    gemma = load(Path(resolve("gemma3-270m")), threads)
    code = inspect.getsource(PromptLookup) + inspect.getsource(check_vocabularies)
    text = f"Rewrite this function with one change: rename `sequence` to `tokens`.\n\n```python\n{code}```\n"
    ids = gemma.tokenizer.encode(text)
    case(f"3. Gemma 3 270M, --lookup 3 ({len(ids)}-token editing prompt)", gemma, ids, n, rounds,
         lambda: make_drafter(gemma, None, 3, 2048, False, 0.2, loader))
    if os.environ.get("GGRUN_BENCH_7B") == "1":
        from convert.random_model import SHAPE_7B, LlamaShape, write_random_llama
        big, tiny = cache_dir() / "models" / "random-7b-q4_k_m.gguf", cache_dir() / "bench" / "random-7b-draft.gguf"
        if not big.exists():
            write_random_llama(big, SHAPE_7B, progress=False)
        if not tiny.exists():
            write_random_llama(tiny, LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                                                vocab_size=SHAPE_7B.vocab_size), progress=False)
        target7b = load(big, threads)
        case("4. 7B-shaped random target, tiny random draft", target7b, [1, 500, 600, 700], max(8, n // 8), rounds,
             lambda: make_drafter(target7b, str(tiny), 0, 2048, False, 0.2, loader))


if __name__ == "__main__":
    start = time.perf_counter()
    main(*map(int, sys.argv[1:3]))
    print(f"({time.perf_counter() - start:.0f} s)")
