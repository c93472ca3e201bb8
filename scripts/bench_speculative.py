"""Speculative decoding's speed-up, measured in one process, plain and speculative decoding
alternating (runner.measure.bench.speculative_row: ROUNDS rounds each after a warm-up, means), greedy,
2 threads unless GGRUN_THREADS says:
  1. SmolLM2-135M as F32 (the registry Q4_1 file widened) with the Q4_1 file as its draft;
  2. the same F32 target with self:Q4_0;
  3. Gemma 3 270M with --lookup 3 on an editing prompt (ggrun's own PromptLookup and
     check_vocabularies, and "rewrite it with one change");
  4. convert.random_model's 7B shape (Q4_K_M) with a 2-layer draft of the same generator and
     vocabulary: random weights accept next to nothing, so this is what failing speculation costs
     (skipped without GGRUN_BENCH_7B=1: the file is ~4 GB, made once in the cache).
Prints the CPU and its vector features, then each case's decode tok/s, the ratio, whether the
greedy text stayed the same, and the drafts' statistics.
Usage: python scripts/bench_speculative.py [N_TOKENS] [ROUNDS]
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
from runner.engine.load import LoadOptions  # noqa: E402
from runner.engine.session import load  # noqa: E402
from runner.engine.speculative import (DRAFT_P_MIN, PromptLookup, check_vocabularies,  # noqa: E402
                                       describe_speculation, make_drafter)
from runner.fetch.registry import cache_dir, resolve  # noqa: E402
from runner.measure.bench import speculative_row  # noqa: E402


def case(name, lm, n, rounds, new_drafter, prompt=None):
    s = speculative_row(lm, new_drafter, n, rounds, draft_max=16, prompt=prompt)
    same = "identical" if s["same_text"] else "DIFFERENT"
    print(f"{name}: plain {s['plain_tok_s']:.1f} tok/s, speculative {s['speculative_tok_s']:.1f} tok/s, ratio "
          f"{s['speedup']:.2f}, greedy text {same}; {describe_speculation(s)}", flush=True)


def main(n=128, rounds=2):
    threads = int(os.environ.get("GGRUN_THREADS", "2"))
    print(cpu_description(), int8_isa(), f"{threads} threads", flush=True)
    smollm = Path(resolve("smollm2-135m-instruct"))
    f32 = cache_dir() / "bench" / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        f32.parent.mkdir(parents=True, exist_ok=True)
        requantize(smollm, f32, "F32", progress=False)
    target = load(f32, LoadOptions(threads=threads))

    def loader(path):
        return load(Path(resolve(str(path))), LoadOptions(threads=threads))
    case("1. F32 target, Q4_1 draft", target, n, rounds,
         lambda: make_drafter(target, str(smollm), 0, 2048, False, DRAFT_P_MIN, loader))
    case("2. F32 target, self:Q4_0", target, n, rounds,
         lambda: make_drafter(target, "self:Q4_0", 0, 2048, False, DRAFT_P_MIN, loader))
    gemma = load(Path(resolve("gemma3-270m")), LoadOptions(threads=threads))
    code = inspect.getsource(PromptLookup) + inspect.getsource(check_vocabularies)
    text = f"Rewrite this function with one change: rename `sequence` to `tokens`.\n\n```python\n{code}```\n"
    ids = gemma.tokenizer.encode(text)
    case(f"3. Gemma 3 270M, --lookup 3 ({len(ids)}-token editing prompt)", gemma, n, rounds,
         lambda: make_drafter(gemma, None, 3, 2048, False, DRAFT_P_MIN, loader), ids)
    if os.environ.get("GGRUN_BENCH_7B") == "1":
        from convert.random_model import SHAPE_7B, LlamaShape, write_random_llama
        big, tiny = cache_dir() / "models" / "random-7b-q4_k_m.gguf", cache_dir() / "bench" / "random-7b-draft.gguf"
        if not big.exists():
            write_random_llama(big, SHAPE_7B, progress=False)
        if not tiny.exists():
            write_random_llama(tiny, LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                                                vocab_size=SHAPE_7B.vocab_size), progress=False)
        target7b = load(big, LoadOptions(threads=threads))
        case("4. 7B-shaped random target, tiny random draft", target7b, max(8, n // 8), rounds,
             lambda: make_drafter(target7b, str(tiny), 0, 2048, False, DRAFT_P_MIN, loader), [1, 500, 600, 700])


if __name__ == "__main__":
    start = time.perf_counter()
    main(*map(int, sys.argv[1:3]))
    print(f"({time.perf_counter() - start:.0f} s)")
