"""Speculative decoding (runner/engine/speculative.py) on tiny random models: token for token plain
decoding at temperature 0 with every kind of draft, the KV cache left as plain decoding leaves it,
the target's own distribution when sampling (chi-square), refused vocabularies."""
from __future__ import annotations

import math

import numpy as np
import pytest

from runner.engine.generate import generate
from runner.engine.sampler import Sampler, SamplingOptions
from runner.engine.speculative import (DraftError, DraftModel, PromptLookup, SpeculationStats, check_vocabularies,
                                       generate_speculative, make_drafter, verify)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An F32 target, another model of the same vocabulary, and one of another vocabulary."""
    from convert.random_model import LlamaShape, write_random_llama
    from runner.engine.load import LoadOptions, load_model
    root = tmp_path_factory.mktemp("spec")
    shapes = {"target": (LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=1000), "F32"),
              "other": (LlamaShape(n_layer=1, n_embd=128, n_head=2, n_head_kv=1, n_ff=256, vocab_size=1000), "Q8_0"),
              "alien": (LlamaShape(n_layer=1, n_embd=128, n_head=2, n_head_kv=1, n_ff=256, vocab_size=1200), "Q8_0")}
    out = {}
    for name, (shape, type_name) in shapes.items():
        write_random_llama(root / f"{name}.gguf", shape, type_name, progress=False, tiled=False)
        out[name] = load_model(root / f"{name}.gguf", LoadOptions(kv_type="f32"))
    return out


def _drafter(models, kind, n_ctx, monkeypatch, tmp_path):
    from runner.engine.load import LoadOptions, load_model
    monkeypatch.setenv("GGRUN_CACHE_DIR", str(tmp_path))
    draft = {"same model": str(models["target"].file.path), "other model": str(models["other"].file.path),
             "self:Q4_0": "self:Q4_0"}.get(kind)
    return make_drafter(models["target"], draft, 2 if kind == "lookup" else 0, n_ctx, False, 0.0,
                        lambda path: load_model(path, LoadOptions(kv_type="f32")))


@pytest.mark.parametrize("kind", ["same model", "other model", "self:Q4_0", "lookup"])
def test_greedy_speculation_is_plain_decoding_token_for_token(models, kind, monkeypatch, tmp_path):
    """The same tokens as plain greedy decoding, and a cache that continues alike (the next
    token's logits equal): rejected drafts left nothing behind."""
    target, n_ctx = models["target"], 256
    prompt = [1] + list(range(300, 320)) * 2  # (repetition gives the lookup something to find)
    plain_cache, spec_cache = target.model.new_cache(n_ctx), target.model.new_cache(n_ctx)
    greedy = SamplingOptions(temperature=0)
    want = list(generate(target.model, plain_cache, prompt, Sampler(greedy), 48, stop_ids=()))
    spec = SpeculationStats()
    drafter = _drafter(models, kind, n_ctx, monkeypatch, tmp_path)
    got = list(generate_speculative(target.model, spec_cache, prompt, Sampler(greedy), 48, (), drafter,
                                    draft_max=6, spec=spec))
    assert got == want
    assert spec_cache.used == plain_cache.used == len(prompt) + 48
    a, b = (target.model.forward([7], c) for c in (plain_cache, spec_cache))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert spec.passes <= 47  # (the first token comes from the prompt's pass)
    if kind == "same model":
        assert spec.accepted == spec.proposed > 0


def test_stops_leave_only_the_tokens_handed_out_in_the_cache(models):
    """A stop id inside an accepted draft ends the output there, and the cache holds exactly the
    prompt and the tokens handed out (as plain decoding leaves it)."""
    target = models["target"]
    prompt, greedy = [1, 5, 6, 7], SamplingOptions(temperature=0)
    want = list(generate(target.model, target.model.new_cache(128), prompt, Sampler(greedy), 30, stop_ids=()))
    stop = want[12]
    cache = target.model.new_cache(128)
    drafter = DraftModel(target, 128, ring=False, p_min=0.0)  # (the target as its own draft: all accepted)
    got = list(generate_speculative(target.model, cache, prompt, Sampler(greedy), 30, {stop}, drafter, draft_max=8))
    assert got == want[:want.index(stop)] and cache.used == len(prompt) + len(got)


def test_sampling_follows_the_target_distribution(models):
    """Chi-square of many draws (fixed context, fixed seed) against the target's sampling
    distribution after top-k, top-p and min-p: drafting a likely token, an unlikely one and one
    the filters drop leaves it the same."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(60) * 2).astype(np.float32)
    options = SamplingOptions(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=1)
    reference = Sampler(options).choose(logits, [])
    want = dict(zip(reference.ids.tolist(), np.exp(reference.logprobs)))
    order = reference.ids.tolist()
    dropped = int(np.argsort(logits)[0])
    n = 20000
    for draft_token in (order[0], order[len(order) // 2], dropped):
        sampler = Sampler(options)
        counts = {}
        for _ in range(n):
            token = verify(sampler, np.stack([logits, logits]), [draft_token], [])[0][0]
            counts[token] = counts.get(token, 0) + 1
        assert set(counts) <= set(want)
        chi2 = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in want.items())
        k = len(want) - 1  # degrees of freedom; the 0.001 critical value (Wilson-Hilferty)
        critical = k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3
        assert chi2 < critical, (draft_token, chi2, critical)


def test_a_draft_of_another_vocabulary_is_refused(models):
    with pytest.raises(DraftError, match="vocabulary has 1200 tokens, the target's 1000"):
        check_vocabularies(models["target"], models["alien"])
    check_vocabularies(models["target"], models["other"])


def test_prompt_lookup_proposes_what_followed_the_last_n_gram():
    lookup = PromptLookup(2)
    assert lookup.propose([5, 6, 7, 8, 9, 1, 5, 6], 3, 0) == [7, 8, 9]
    assert lookup.propose([5, 6, 7, 5, 6, 9, 4, 5, 6], 2, 0) == [9, 4]  # (the latest occurrence)
    assert lookup.propose([1, 2, 3, 4], 3, 0) == []
    assert lookup.propose([5, 6, 7, 5, 6], 3, 2) == [7, 5, 6]


def test_expected_tokens_per_pass():
    s = SpeculationStats(proposed=10, accepted=5, passes=4, generated=9, draft_max=4)
    assert s.expected_tokens_per_pass() == pytest.approx((1 - 0.5 ** 5) / 0.5)
    assert s.tokens_per_pass == 2.25


@pytest.mark.parametrize("kind", ["model", "self:Q4_0", "lookup"])
@pytest.mark.parametrize("name", ["smollm_path", "gemma_path"])
def test_real_models_speculate_token_for_token(request, name, kind, monkeypatch, tmp_path):
    """SmolLM2 and Gemma 3 at temperature 0: plain decoding's tokens with each kind of draft (a
    model: the file itself)."""
    from runner.engine.load import LoadOptions, load_model
    monkeypatch.setenv("GGRUN_CACHE_DIR", str(tmp_path))
    path = request.getfixturevalue(name)
    target = load_model(path, LoadOptions(kv_type="f32"))
    text = "def add(a, b):\n    return a + b\n\nRewrite add so that it also prints its arguments:\n"
    prompt = target.tokenizer.encode(text)
    greedy = SamplingOptions(temperature=0)
    want = list(generate(target.model, target.model.new_cache(256), prompt, Sampler(greedy), 40, stop_ids=()))
    draft = {"model": str(path), "self:Q4_0": "self:Q4_0"}.get(kind)
    drafter = make_drafter(target, draft, 3 if kind == "lookup" else 0, 256, False, 0.5,
                           lambda path: load_model(path, LoadOptions(kv_type="f32")))
    spec = SpeculationStats()
    got = list(generate_speculative(target.model, target.model.new_cache(256), prompt, Sampler(greedy), 40, (),
                                    drafter, spec=spec))
    assert got == want
    assert spec.passes < 40


def test_torch_backend_speculates_through_the_same_path(models):
    pytest.importorskip("torch")
    from runner.engine.load import LoadOptions, load_model
    target = load_model(models["target"].file.path, LoadOptions(kv_type="f32", device="torch-cpu"))
    greedy = SamplingOptions(temperature=0)
    prompt = [1, 5, 6, 7]
    want = list(generate(target.model, target.model.new_cache(128), prompt, Sampler(greedy), 24, stop_ids=()))
    drafter = DraftModel(load_model(models["other"].file.path, LoadOptions(kv_type="f32", device="torch-cpu")), 128, ring=False, p_min=0.0)
    got = list(generate_speculative(target.model, target.model.new_cache(128), prompt, Sampler(greedy), 24, (),
                                    drafter, draft_max=4))
    assert got == want


def test_run_reports_the_drafts(smollm_path):
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "runner", "run", smollm_path, "-p", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,",
                        "--temp", "0", "-n", "16", "--lookup", "2", "--json"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"draft_proposed", "draft_accepted", "acceptance", "target_passes", "tokens_per_pass",
            "expected_tokens_per_pass", "draft_max"} <= set(out)
    assert out["draft_proposed"] > 0 and out["target_passes"] < out["generated_tokens"]
    bad = subprocess.run([sys.executable, "-m", "runner", "run", smollm_path, "-p", "x", "-n", "2", "--draft",
                          "self:Q9_9"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "self:Q9_9: unknown type" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", ["smollm_path", "gemma_path", "smollm_f32"])
def test_a_pass_of_a_few_tokens_computes_them_as_single_steps(request, name):
    """Bit for bit (what greedy verification rests on), whether the products take the tokens
    several per pass or one at a time. Found so: Gemma 3's per-head K norms over a stacked
    product's strided rows once rounded differently for several tokens than for one (0.17-0.8 in
    the logits, past the 8-bit activations), and so did SwiGLU's gate over strided columns (1e-8,
    which F32 weights keep and an 8-bit rounding now and then turns into 0.8). Eager and replayed
    alike."""
    from runner.engine.load import LoadOptions, load_model
    lm = load_model(request.getfixturevalue(name), LoadOptions(kv_type="f32"))
    m = lm.model
    for n_prompt in (20, 40):
        prompt, chunk = list(range(1000, 1000 + n_prompt)), [2000, 2001, 2002, 2003, 2004, 2005, 2006]
        a, b = m.new_cache(256), m.new_cache(256)
        m.forward(prompt, a)
        m.forward(prompt, b)
        steps = np.stack([m.forward([t], a).copy() for t in chunk])
        for _ in range(3):  # recorded, replayed against an eager pass, replayed
            assert np.array_equal(m.forward(chunk, b, all_logits=True), steps)
            b.truncate(b.used - len(chunk))


def test_bench_measures_speculation_beside_plain_decoding(smollm_path):
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "runner", "bench", smollm_path, "-p", "0", "-n", "12", "-r", "1",
                        "--lookup", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)[-1]
    assert row["test"] == "tg12 speculative" and row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0
    assert row["speedup"] == pytest.approx(row["speculative_tok_s"] / row["plain_tok_s"])


def test_chat_drafts_and_replies_as_without(smollm_path):
    """Two greedy turns with a lookup draft (over the conversation's tokens): the replies of plain
    chat, and /stats counts the drafts."""
    from runner.engine.conversation import ChatSession
    from runner.engine.load import LoadOptions, load_model
    from runner.terminal.chat_repl import format_stats
    lm = load_model(smollm_path, LoadOptions(kv_type="f32"))
    greedy = SamplingOptions(temperature=0)
    plain = ChatSession(lm, 512, greedy, max_reply=24)
    drafted = ChatSession(lm, 512, greedy, max_reply=24, drafter=PromptLookup(2), draft_max=6)
    for text in ("Name three colours.", "Now repeat exactly what you said."):
        assert drafted.send(text) == plain.send(text)
    stats = drafted.stats()
    assert stats["draft_proposed"] > 0 and stats["target_passes"] > 0 and "drafts:" in format_stats(stats)
    assert drafted.tokens and drafted.cache.used == plain.cache.used == len(drafted.tokens)


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("undo", [True, False])
def test_rejected_drafts_inside_a_wrapped_ring_give_back_what_they_overwrote(models, device, undo):
    """With undo_overwrites (generate_speculative sets it), a verification pass's rejected tokens
    give back the oldest ring slots they took, byte for byte as they were; without it, those
    slots stay empty (the context holds fewer tokens until it fills again)."""
    if device == "torch-cpu":
        pytest.importorskip("torch")
    from runner.engine.load import LoadOptions, load_model
    target = load_model(models["target"].file.path, LoadOptions(device=device, kv_type="q8_0"))
    m, ids = target.model, list(range(300, 370))
    cache = m.new_cache(24, ring=True)
    m.forward(ids[:4], cache)
    cache.pin()
    for i in range(4, 50, 6):
        m.forward(ids[i:min(i + 6, 50)], cache)
    cache.undo_overwrites = undo
    before = cache.snapshot()
    m.forward(ids[50:56], cache, all_logits=True)  # [last] + five drafts: four of them rejected
    cache.truncate(52)
    after = cache.snapshot()
    (table,), (old_table,) = after.positions, before.positions
    new = table >= 50
    assert sorted(table[new]) == [50, 51] and after.used == 52
    if not undo:
        assert np.count_nonzero(table == -1) == 4 and after.evicted == before.evicted + 6
        return
    assert np.array_equal(table[~new], old_table[~new]) and after.evicted == before.evicted + 2
    unpinned = ~new & (np.arange(len(table)) >= cache.pinned)  # (the pinned keys re-rotate on the next pass)
    for rows, old_rows in zip(after.keys + after.values, before.keys + before.values):
        assert np.array_equal(rows[:, unpinned], old_rows[:, unpinned])
    m.forward(ids[60:62], cache, all_logits=True)
    assert cache.used == 54 and not cache.rotates_pinned
