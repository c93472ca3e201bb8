"""The ring-style context window: exact before it wraps, bounded distances after, and perplexity
close to that of a freshly computed window."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runner.engine.conversation import ChatSession
from runner.engine.sampler import SamplingOptions
from runner.measure.perplexity import ring_perplexity

TEXT = (Path(__file__).parent / "data" / "ppl_text.txt").read_text()


def test_ring_equals_plain_cache_before_the_first_wrap(smollm):
    ids = smollm.tokenizer.encode(TEXT)[:50]
    plain, ring = smollm.model.new_cache(64), smollm.model.new_cache(64, ring=True)
    for cache in (plain, ring):
        smollm.model.forward(ids[:4], cache)
        cache.pin()
        smollm.model.forward(ids[4:40], cache)
        for t in ids[40:]:
            smollm.model.forward([t], cache)
    for layer in range(smollm.params.n_layer):
        assert np.array_equal(plain.keys[layer], ring.keys[layer])
        assert np.array_equal(plain.values[layer], ring.values[layer])
    assert ring.evicted == 0


def test_distances_stay_below_the_context_after_many_wraps(smollm):
    n_ctx = 24
    ids = smollm.tokenizer.encode(TEXT)
    cache = smollm.model.new_cache(n_ctx, ring=True)
    smollm.model.forward(ids[:4], cache)
    cache.pin()
    pinned_as_written = cache.snapshot().pinned_keys[0]
    be, p = smollm.backend, smollm.params
    for t in ids[4:4 + 10 * (n_ctx - 4) + 7]:  # ten wraps and then some
        smollm.model.forward([t], cache)
        if cache.used < n_ctx:
            continue
        query = cache.used - 1
        table = cache.positions[("global", n_ctx)]
        ring_pos = table[cache.pinned:]
        assert sorted(ring_pos) == list(range(query - (n_ctx - cache.pinned) + 1, query + 1))
        assert query - ring_pos.min() < n_ctx
        # pinned keys sit just before the ring's oldest token: their distance is below the context too
        assert all(query - (j + cache.shift) < n_ctx for j in range(cache.pinned))
        assert cache.pinned + cache.shift - 1 < ring_pos.min()
    assert cache.evicted == cache.used - n_ctx
    # and the cached pinned keys really are rotated to their shifted positions
    want = pinned_as_written.copy()
    be.rope(want, np.full(cache.pinned, cache.shift, np.int32), p.rope_dim, p.rope_base, p.rope_scale,
            smollm.model.rope_neox, smollm.model.rope_factors[False])
    assert np.allclose(be.read_kv(cache.keys[0], cache.values[0], cache.pinned)[0], want, atol=1e-5)


def test_ring_perplexity_is_close_to_fresh_windows(smollm):
    n = 32
    ids = smollm.tokenizer.encode(TEXT)[:8 * n + 1]
    text = smollm.tokenizer.decode(ids)
    assert smollm.tokenizer.encode(text) == ids
    ring = ring_perplexity(smollm, text, n, progress=False, step=n)
    # the slow reference: every token scored from a fresh computation over its n most recent tokens
    nll = []
    for t in range(1, len(ids)):
        window = ids[max(0, t - n):t]
        logits = smollm.model.forward(window, smollm.model.new_cache(n)).astype(np.float64)
        m = logits.max()
        nll.append(m + np.log(np.exp(logits - m).sum()) - logits[ids[t]])
    reference = float(np.exp(np.mean(nll)))
    assert ring.tokens_scored == len(ids) - 1
    assert abs(ring.ppl / reference - 1) < 0.05, (ring.ppl, reference)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_5000_tokens_through_a_256_slot_ring(smollm):
    session = ChatSession(smollm, 256, SamplingOptions(temperature=0.9, seed=5, repeat_penalty=1.1),
                          system="You are a storyteller.", max_reply=600)
    session.send("Tell me a long story about a lighthouse keeper.")
    rss_start = _rss_mib()
    generated = session.last.generated_tokens
    turns = 0
    while generated < 5000:
        session.send("Go on, tell me what happens next, in detail.")
        generated += session.last.generated_tokens
        turns += 1
        assert turns < 200
    stats = session.stats()
    assert stats["context_used"] == 256 and stats["tokens_evicted"] > 4000
    assert stats["pinned"] == session.cache.pinned > 0
    assert _rss_mib() - rss_start < 30, "memory grew while the ring wrapped"


def test_run_uses_the_ring_unless_told_not_to(smollm_path, smollm):
    import subprocess
    import sys
    args = [sys.executable, "-m", "runner", "run", str(smollm_path), "-p", "Once upon a time", "--temp", "0",
            "-n", "60", "-c", "32", "--json"]
    ring = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert ring.returncode == 0, ring.stderr
    assert json.loads(ring.stdout)["generated_tokens"] > 28  # more than the context holds
    no_ring = subprocess.run(args + ["--no-ring"], capture_output=True, text=True, timeout=600)
    assert no_ring.returncode == 1 and "exceed the context of 32" in no_ring.stderr
    ppl = subprocess.run([sys.executable, "-m", "runner", "perplexity", str(smollm_path), "-f",
                          str(Path(__file__).parent / "data" / "ppl_text.txt"), "--ring", "64", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert ppl.returncode == 0, ppl.stderr
    doc = json.loads(ppl.stdout)
    n_tokens = len(smollm.tokenizer.encode(TEXT))
    assert doc["tokens_scored"] == n_tokens - 1 and doc["n_ctx"] == 64  # every token but the first, once
