"""Continuous batching (runner/engine/batching.py): sequences joining and leaving a shared decode pass
generate, at temperature 0, the tokens each generates alone."""
from __future__ import annotations

import numpy as np
import pytest

from runner.engine.batching import Batcher
from runner.engine.generate import generate
from runner.engine.kv_cache import ContextFullError
from runner.engine.load import LoadOptions, load_model
from runner.engine.sampler import Sampler, SamplingOptions

GREEDY = SamplingOptions(temperature=0)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,",
           "The cat sat on the mat. " * 30, "Water boils at"]


def alone(lm, ids, n):
    """Plain generation of one sequence (runner/engine/generate.py), as `ggrun run` does it."""
    return list(generate(lm.model, lm.model.new_cache(512), ids, Sampler(GREEDY), n,
                         lm.tokenizer.vocab.end_of_generation))


def alone_in_a_batcher(lm, ids, n):
    """One sequence through a batcher of its own: a prompt longer than a prefill chunk comes in
    by the same chunks as beside others (a one-pass prefill's products may round otherwise)."""
    batcher = Batcher(lm, slots=1, n_ctx=512)
    seq = batcher.add(ids, Sampler(GREEDY), n)
    drain(batcher)
    return seq.tokens


def drain(batcher, limit=10_000):
    for _ in range(limit):
        if not batcher.step():
            return
    raise AssertionError("the batcher did not finish")


@pytest.fixture(scope="module")
def lm(smollm_path):
    return load_model(smollm_path, LoadOptions(kv_type="f32"))


def test_sequences_joining_at_any_step_generate_their_tokens_alone(lm):
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    assert len(ids[4]) > 128  # (prefilled in chunks, between decode passes)
    want = [alone_in_a_batcher(lm, i, 16) for i in ids]
    assert [w for w, i in zip(want, ids) if len(i) <= 128] == [alone(lm, i, 16) for i in ids if len(i) <= 128]
    batcher = Batcher(lm, slots=3, n_ctx=512)
    seqs = [batcher.add(i, Sampler(GREEDY), 16) for i in ids[:2]]
    for late in ids[2:]:  # (the others come while those run: one every three steps)
        for _ in range(3):
            batcher.step()
        seqs.append(batcher.add(late, Sampler(GREEDY), 16))
        assert len(batcher.running) <= 3
    drain(batcher)
    assert [s.tokens for s in seqs] == want
    assert all(s.finish_reason in ("length", "eos") for s in seqs)
    assert not batcher.running and not batcher.waiting
    # (passes of three lanes were recorded, and their replay agreed with an eager pass bit for bit)
    assert lm.backend.recorded_program(lm.model, "f32", 3, True, lanes=(1, 1, 1)) is not None


def test_a_decode_pass_takes_every_running_sequence(lm, monkeypatch):
    passes = []
    batcher = Batcher(lm, slots=4, n_ctx=256)
    decode = batcher._decode
    monkeypatch.setattr(batcher, "_decode", lambda seqs: passes.append(len(seqs)) or decode(seqs))
    for p in PROMPTS[:4]:
        batcher.add(lm.tokenizer.encode(p), Sampler(GREEDY), 8, stop_ids=())
    drain(batcher)
    # (one prompt prefilled a step; each then decodes 7 tokens after the prefill's first)
    assert passes == [1, 2, 3, 4, 4, 4, 4, 3, 2, 1]


def test_a_cancelled_sequence_leaves_within_a_step(lm):
    batcher = Batcher(lm, slots=2, n_ctx=256)
    ids = [lm.tokenizer.encode(p) for p in PROMPTS[:3]]
    a, b = (batcher.add(i, Sampler(GREEDY), 64, stop_ids=()) for i in ids[:2])
    c = batcher.add(ids[2], Sampler(GREEDY), 8, stop_ids=())
    for _ in range(4):
        batcher.step()
    a.cancelled = True  # (set from another thread, read between steps)
    n = len(a.tokens)
    batcher.step()
    assert a.finish_reason == "cancelled" and len(a.tokens) == n and a.cache is None
    drain(batcher)
    assert b.tokens == alone(lm, ids[1], 64)[:len(b.tokens)] and len(b.tokens) == 64
    assert c.tokens == alone(lm, ids[2], 8)  # (it took the slot a left)


def test_a_shared_prefix_is_prefilled_once(lm):
    system = lm.tokenizer.encode("You are a helpful assistant who answers in one short sentence. " * 8)
    first, second = (system + lm.tokenizer.encode(" The capital of France is"),
                     system + lm.tokenizer.encode(" The capital of Italy is"))
    batcher = Batcher(lm, slots=1, n_ctx=512)
    s1 = batcher.add(first, Sampler(GREEDY), 6, stop_ids=())
    drain(batcher)
    s2 = batcher.add(second, Sampler(GREEDY), 6, stop_ids=())
    drain(batcher)
    assert s1.cached_tokens == 0 and s2.cached_tokens >= len(system) - 1
    # (a fresh prefill's first token, whose lead is wide: where the prompt's passes are split
    # moves the logits a little, by the products' rounding, which could turn a near tie)
    rome = lm.tokenizer.piece(alone(lm, second, 1)[0])
    assert len(s2.tokens) == 6 and lm.tokenizer.piece(s2.tokens[0]) == rome == " Rome"
    # the next turn of a conversation: only its new tokens are prefilled
    turn = second + s2.tokens + lm.tokenizer.encode(" And of Spain?")
    s3 = batcher.add(turn, Sampler(GREEDY), 4, stop_ids=())
    drain(batcher)
    assert s3.cached_tokens == len(second) + len(s2.tokens) - 1


def test_context_limits(lm):
    batcher = Batcher(lm, slots=1, n_ctx=32)
    with pytest.raises(ContextFullError, match="32"):
        batcher.add(list(range(100, 140)), Sampler(GREEDY), 4)
    seq = batcher.add(lm.tokenizer.encode("1, 2, 3, 4, 5, 6,"), Sampler(GREEDY), 100, stop_ids=())
    drain(batcher)
    assert seq.finish_reason == "context" and len(seq.ids) + len(seq.tokens) <= 32


def test_the_torch_backend_takes_a_lane_a_pass(smollm_path):
    pytest.importorskip("torch")
    lm = load_model(smollm_path, LoadOptions(device="torch-cpu", kv_type="f32"))
    ids = [lm.tokenizer.encode(p) for p in PROMPTS[:2]]
    batcher = Batcher(lm, slots=2, n_ctx=64)
    seqs = [batcher.add(i, Sampler(GREEDY), 4, stop_ids=()) for i in ids]
    drain(batcher)
    for seq, i in zip(seqs, ids):
        want = list(generate(lm.model, lm.model.new_cache(64), i, Sampler(GREEDY), 4, ()))
        assert seq.tokens == want
    # (its products compute a row as a one-row product does for one row alone: one lane a pass)
    assert lm.backend.few_tokens == batcher.lanes == 1
    logits = lm.model.forward_lanes([[5]], [lm.model.new_cache(16)])
    assert logits.shape == (1, lm.params.vocab_size) and np.isfinite(logits).all()
    with pytest.raises(ValueError, match="at most 1 token"):
        lm.model.forward_lanes([[5], [6]], [lm.model.new_cache(16), lm.model.new_cache(16)])


def test_bench_measures_concurrency(smollm_path):
    import json

    from click.testing import CliRunner

    from runner.terminal.cli import main
    r = CliRunner().invoke(main, ["bench", str(smollm_path), "-p", "0", "-n", "4", "-r", "1", "--concurrency", "1,3",
                                  "--json"])
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output[r.output.index("["):]) if "sequences" in row]
    assert [(row["test"], row["sequences"]) for row in rows] == [("tg4 x1", 1), ("tg4 x3", 3)]
    assert rows[0]["vs_first_level"] == 1.0 and all(row["tok_s_mean"] > 0 for row in rows)
    bad = CliRunner().invoke(main, ["bench", str(smollm_path), "--concurrency", "0,2"])
    assert bad.exit_code != 0 and "positive integers" in bad.output


def test_a_lone_sequence_speculates_and_keeps_its_tokens(lm, monkeypatch):
    from runner.engine.speculative import PromptLookup
    ids = lm.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,")
    other = lm.tokenizer.encode("Once upon a time")
    want, want_other = alone(lm, ids, 24), alone(lm, other, 24)
    batcher = Batcher(lm, slots=2, n_ctx=256, drafter=PromptLookup(3), draft_max=6)
    passes = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda t, c, all_logits=False: passes.append(len(t)) or
                        forward(t, c, all_logits))
    seq = batcher.add(ids, Sampler(GREEDY), 24)
    drain(batcher)
    assert seq.tokens == want
    drafted = [n for n in passes[1:] if n > 1]  # (after the prompt's pass)
    assert drafted and len(passes) - 1 < len(want)  # (drafted chunks: fewer passes than tokens)
    # two at once batch instead: the same tokens, each pass one token a sequence
    passes.clear()
    a, b = batcher.add(ids, Sampler(GREEDY), 24, reuse=False), batcher.add(other, Sampler(GREEDY), 24, reuse=False)
    for _ in range(3):
        batcher.step()
    assert all(n == 1 or n == len(ids) or n == len(other) for n in passes)
    drain(batcher)
    assert (a.tokens, b.tokens) == (want, want_other)


def test_the_pool_holds_the_tokens_in_use(lm):
    """8 sequences of 500 tokens take the KV memory of 4000 tokens, within a block each (not 8
    contexts' worth); the blocks come back as they end."""
    rng = np.random.default_rng(3)
    batcher = Batcher(lm, slots=8, n_ctx=2048)
    seqs = [batcher.add(rng.integers(100, 5000, 480).tolist(), Sampler(GREEDY), 20, stop_ids=()) for _ in range(8)]
    peak = 0
    while batcher.step():
        peak = max(peak, batcher.pool.blocks_used)
    assert all(len(s.tokens) == 20 for s in seqs)
    assert peak * batcher.pool.block <= 1.1 * 4000 < batcher.pool.n_slots
    assert batcher.pool.blocks_used == 0 and batcher.pool.promised == 0


def test_a_long_shared_prefix_is_prefilled_once(lm):
    """A 2000-token system prompt: the first request prefills it; two that share it, at once, and
    one after them prefill only their own tokens (their first tokens as a fresh prefill's)."""
    from pathlib import Path
    text = (Path(__file__).parent / "data" / "declaration_of_independence.txt").read_text()
    system = lm.tokenizer.encode(text * 2)[:2000]
    questions = [lm.tokenizer.encode(q) for q in (" Who wrote it?", " When was it signed?", " Why?", " Where?")]
    batcher = Batcher(lm, slots=2, n_ctx=2304)
    first = batcher.add(system + questions[0], Sampler(GREEDY), 2)
    drain(batcher)
    both = [batcher.add(system + q, Sampler(GREEDY), 2) for q in questions[1:3]]
    drain(batcher)
    last = batcher.add(system + questions[3], Sampler(GREEDY), 2)
    drain(batcher)
    assert first.cached_tokens == 0
    assert all(s.cached_tokens >= len(system) for s in both + [last])
    fresh = Batcher(lm, slots=1, n_ctx=2304)
    alone = fresh.add(system + questions[3], Sampler(GREEDY), 2, reuse=False)
    drain(fresh)
    assert last.tokens[0] == alone.tokens[0]


def test_a_request_waits_for_the_pool_and_one_that_never_fits_is_refused(lm):
    batcher = Batcher(lm, slots=2, n_ctx=1024, kv_tokens=512)  # (two blocks)
    with pytest.raises(ContextFullError, match="KV pool holds 512 tokens"):
        batcher.add(list(range(100, 400)), Sampler(GREEDY), 400)
    a = batcher.add(list(range(100, 400)), Sampler(GREEDY), 100, stop_ids=())  # (two blocks reserved)
    b = batcher.add(list(range(500, 520)), Sampler(GREEDY), 4, stop_ids=())
    batcher.step()
    assert a.cache is not None and b.cache is None  # (a slot is free; the pool is not)
    drain(batcher)
    assert len(a.tokens) == 100 and b.tokens == alone(lm, list(range(500, 520)), 4)


def test_each_sequence_follows_its_own_grammar_batched_or_speculating(lm, monkeypatch):
    """Sequences with grammars (runner/engine/constraint.py), each its own matcher: batched
    together, and a lone one speculating (drafts cut where its grammar rejects them), the greedy
    tokens of a constrained generate() alone; each ends ("eos") where its grammar is complete, or
    says "length" inside it."""
    from runner.engine.constraint import Grammar, Matcher
    from runner.engine.speculative import PromptLookup
    ends = lm.tokenizer.vocab.end_of_generation
    grammars = [Grammar.json_schema({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "maxItems": 8}),
                Grammar.json_schema({"enum": ["red", "green", "blue"]}),
                Grammar.gbnf('root ::= ("yes" | "no") "!"')]
    prompts = [lm.tokenizer.encode(p) for p in ("Repeat it: [1, 2, 3, 1, 2, 3, 1, 2, 3]\nAnswer: ", "A colour:",
                                                "Is water wet?")]

    def constrained_alone(ids, grammar, n=40):
        matcher = Matcher(grammar, lm.tokenizer, lm.params.vocab_size, ends)
        return list(generate(lm.model, lm.model.new_cache(512), ids, Sampler(GREEDY), n, ends, matcher=matcher))
    want = [constrained_alone(ids, g) for ids, g in zip(prompts, grammars)]
    batcher = Batcher(lm, slots=3, n_ctx=256)
    seqs = [batcher.add(ids, Sampler(GREEDY), 40, grammar=g) for ids, g in zip(prompts, grammars)]
    drain(batcher)
    assert [s.tokens for s in seqs] == want and all(s.finish_reason == "eos" for s in seqs)
    assert lm.tokenizer.decode(seqs[2].tokens) in ("yes!", "no!")
    cut = batcher.add(prompts[0], Sampler(GREEDY), 3, grammar=grammars[0])
    drain(batcher)
    assert cut.tokens == want[0][:3] and cut.finish_reason == "length"
    speculating = Batcher(lm, slots=1, n_ctx=256, drafter=PromptLookup(2), draft_max=6)
    passes = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda t, c, all_logits=False: passes.append(len(t)) or
                        forward(t, c, all_logits))
    seq = speculating.add(prompts[0], Sampler(GREEDY), 40, grammar=grammars[0])
    drain(speculating)
    assert seq.tokens == want[0] and seq.finish_reason == "eos"
    assert any(n > 1 for n in passes[1:])  # (drafted chunks, after the prompt's pass)
