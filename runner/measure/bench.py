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


def _context(lm, depth: int, n_steps: int):
    """A cache holding `depth` tokens of random context, room for n_steps more, and a first token."""
    cache = lm.model.new_cache(depth + n_steps + 1)
    token = lm.tokenizer.vocab.bos_id if lm.tokenizer.vocab.bos_id >= 0 else 0
    context = np.random.default_rng(1).integers(0, lm.params.vocab_size, depth).tolist()
    lm.model.forward([token] + context, cache)
    return cache, token


def time_decode(lm, n_gen: int, depth: int = 0) -> float:
    """Decode speed for n_gen tokens after `depth` tokens of context (llama-bench's -d)."""
    cache, token = _context(lm, depth, n_gen)
    start = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(lm.model.forward([token], cache)))
    return n_gen / (time.perf_counter() - start)


def depth_steps(lm, n_gen: int, depths) -> list[float]:
    """Seconds per decode step at each depth, from n_gen single steps at every depth taken in turn
    (medians). A shared machine's memory speed drifts between separate runs; steps alternating
    between the depths see the same drift, so their ratios hold across it."""
    warm_up = 2  # (a model's first step is recorded, the second replays it)
    contexts = [list(_context(lm, depth, n_gen + warm_up)) for depth in depths]
    seconds = [[] for _ in depths]
    for step in range(n_gen + warm_up):
        order = range(len(depths)) if step % 2 else reversed(range(len(depths)))
        for i in order:
            cache, token = contexts[i]
            start = time.perf_counter()
            contexts[i][1] = int(np.argmax(lm.model.forward([token], cache)))
            if step >= warm_up:
                seconds[i].append(time.perf_counter() - start)
    return [float(np.median(s)) for s in seconds]


def read_share(t, p) -> float:
    """The share of a tensor a decode step reads: of a mixture's expert tensors (3-D, one slice
    per expert), the experts a token uses; all of any other."""
    if p.n_expert and len(t.shape) == 3 and t.shape[2] == p.n_expert:
        return p.n_expert_used / p.n_expert
    return 1.0


def weight_bytes_per_token(f, p) -> int:
    """Weight bytes a decode step reads: every tensor once, a mixture's chosen experts only, and
    only one row of an untied token embedding and of per-layer token embeddings (Gemma 4's)."""
    untied = "output.weight" in f.tensors
    return round(sum(t.nbytes * read_share(t, p) for name, t in f.tensors.items()
                     if not (untied and name == "token_embd.weight") and name != "per_layer_token_embd.weight"))


def parameter_counts(f, p) -> tuple[int, int]:
    """(all, active per token): a mixture's token uses its chosen experts' parameters alone."""
    return (sum(t.n_elements for t in f.tensors.values()),
            round(sum(t.n_elements * read_share(t, p) for t in f.tensors.values())))


def run_bench(lm, n_prompt: int, n_gen: int, repetitions: int, depths=(0,)) -> list[dict]:
    """pp and tg rows as llama-bench prints them; tg rows also carry the bytes a decode step reads
    (weights, and the KV cache at that depth) and the share of the memory bandwidth, measured in
    the same run, that their speed implies, and with several depths their speed against the first
    depth's (depth_steps) beside the most that reading the deeper cache at that bandwidth allows."""
    from kernels_cpu.cpu_features import cpu_description

    from ..engine.load import memory_fit
    f, p = lm.file, lm.params
    n_params, n_active = parameter_counts(f, p)
    base = {"model": f.path.name, "arch": p.arch, "quant": f.file_type_name(), "size_mib": f.size / 2**20,
            "params_m": n_params / 1e6, "active_params_m": n_active / 1e6,
            "bits_per_weight": f.bits_per_weight(), "backend": lm.backend.label, "threads": lm.backend.threads,
            "kv_type": lm.model.kv_type, "cpu": cpu_description(),
            "decode_products": lm.backend.decode_products}
    bandwidth = lm.backend.read_bandwidth()
    fit = memory_fit(f, p, lm.model.kv_type)
    # as llama-bench: -p 0 skips prefill, -n 0 skips decode
    tests = [("pp", n_prompt, 0, lambda k: _time_prefill(lm, k))] if n_prompt else []
    tests += [("tg", n_gen, d, lambda k, d=d: time_decode(lm, k, d)) for d in depths] if n_gen else []
    steps = dict(zip(depths, depth_steps(lm, n_gen, depths))) if len(depths) > 1 and n_gen else {}
    rows = []
    for test, n, depth, run in tests:
        # warm-up: loads every kernel outside the measurement; 32 tokens, as backends switch to
        # their prefill kernels above a few tokens (8 on the CPU)
        run(min(n, 32))
        speeds = [run(n) for _ in range(repetitions)]
        row = dict(base, test=f"{test}{n}" + (f"@d{depth}" if depth else ""), n_tokens=n, depth=depth,
                   repetitions=repetitions, tok_s_mean=float(np.mean(speeds)), tok_s_std=float(np.std(speeds)),
                   tok_s=[float(s) for s in speeds], bandwidth_gb_s=bandwidth / 1e9,
                   read_mib_per_token=None, bandwidth_fraction=None,
                   speed_vs_first_depth=None, bandwidth_limit_vs_first_depth=None)
        if test == "tg":
            # (a hybrid's step reads its recurrent state and writes it back)
            per_token = weight_bytes_per_token(f, p) + fit.kv_bytes(depth + n // 2, 1) + 2 * fit.state_bytes
            row.update(read_mib_per_token=per_token / 2**20,
                       bandwidth_fraction=per_token * row["tok_s_mean"] / bandwidth)
        if test == "tg" and steps:
            # the most the deeper cache's extra bytes allow: the first depth's step, plus reading
            # them at the measured bandwidth (reads held in the CPU caches can beat it, so only
            # for extra bytes well beyond them is it a bound)
            first = steps[depths[0]]
            extra = fit.kv_bytes(depth + n // 2, 1) - fit.kv_bytes(depths[0] + n // 2, 1)
            row.update(speed_vs_first_depth=first / steps[depth],
                       bandwidth_limit_vs_first_depth=first / (first + extra / bandwidth))
        rows.append(row)
    return rows


# (a natural prompt: a draft agrees with a target on text, hardly on random tokens)
SPECULATION_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def speculative_row(lm, new_drafter, n_gen: int, repetitions: int, draft_max: int = 16, draft_min: int = 0,
                    prompt: list[int] | None = None) -> dict:
    """Greedy decode of n_gen tokens after prompt (default: SPECULATION_PROMPT's), plainly and with
    speculation, alternating in this process (repetitions each, after a warm-up of both): their
    speeds, the speed-up, whether the texts were the same, and the drafts' statistics
    (runner/engine/speculative.py)."""
    from ..engine.generate import GenerationStats, generate
    from ..engine.sampler import Sampler, SamplingOptions
    from ..engine.speculative import SpeculationStats, generate_speculative
    prompt = prompt or lm.tokenizer.encode(SPECULATION_PROMPT)

    def decode(drafter):
        cache, stats, spec = lm.model.new_cache(len(prompt) + n_gen + 1), GenerationStats(), SpeculationStats()
        sampler = Sampler(SamplingOptions(temperature=0))
        if drafter is None:
            list(generate(lm.model, cache, prompt, sampler, n_gen, (), stats))
        else:
            list(generate_speculative(lm.model, cache, prompt, sampler, n_gen, (), drafter, draft_max, draft_min,
                                      stats, spec))
        return stats, spec
    decode(None), decode(new_drafter())  # (warm-up)
    plain, speculative = [], []
    for _ in range(repetitions):
        plain.append(decode(None)[0])
        speculative.append(decode(new_drafter()))
    stats, spec = speculative[-1]
    plain_tok_s, speculative_tok_s = (float(np.mean([s.decode_tok_s for s in runs]))
                                      for runs in (plain, [s for s, _ in speculative]))
    return {"test": f"tg{n_gen} speculative", "plain_tok_s": plain_tok_s, "speculative_tok_s": speculative_tok_s,
            "speedup": speculative_tok_s / plain_tok_s, "same_text": stats.tokens == plain[-1].tokens,
            **spec.as_dict()}


def concurrency_rows(lm, levels: list[int], n_gen: int, repetitions: int) -> list[dict]:
    """Decode through continuous batching (runner/engine/batching.py) with N sequences at once, for each
    N of levels taken in turn each repetition (after a warm-up of each): aggregate and
    per-sequence tok/s over the steps after every prompt is in, and the aggregate against the
    first level's."""
    from ..engine.batching import Batcher
    from ..engine.sampler import Sampler, SamplingOptions
    rng = np.random.default_rng(2)

    def aggregate(n: int, steps: int) -> float:
        batcher = Batcher(lm, slots=n, n_ctx=16 + steps + 8)
        seqs = [batcher.add(rng.integers(0, lm.params.vocab_size, 16).tolist(), Sampler(SamplingOptions(temperature=0)),
                            steps, stop_ids=()) for _ in range(n)]
        while any(s.pending or s.cache is None for s in seqs if not s.finished):
            batcher.step()
        before, start = sum(len(s.tokens) for s in seqs), time.perf_counter()
        while batcher.step():
            pass
        return (sum(len(s.tokens) for s in seqs) - before) / (time.perf_counter() - start)
    for n in levels:
        aggregate(n, 4)
    speeds = {n: [] for n in levels}
    for _ in range(repetitions):
        for n in levels:
            speeds[n].append(aggregate(n, n_gen))
    first = float(np.mean(speeds[levels[0]]))
    return [{"test": f"tg{n_gen} x{n}", "sequences": n, "tok_s_mean": float(np.mean(s)),
             "tok_s_std": float(np.std(s)), "per_sequence_tok_s": float(np.mean(s)) / n,
             "vs_first_level": float(np.mean(s)) / first} for n, s in speeds.items()]
