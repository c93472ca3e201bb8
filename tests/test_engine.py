"""The engine layer that run, chat and bench share: a Session takes a prompt to text over one cache,
and the sampler says which distribution it drew each token from."""
from __future__ import annotations

import numpy as np
import pytest

from runner.engine.generate import GenerationStats, generate
from runner.engine.sampler import Sampler, SamplingOptions
from runner.engine.session import PromptError, Session, ring_pin


def test_a_session_completes_as_the_generate_loop_does(smollm):
    session = Session.new(smollm, 128)
    ids = session.prompt_ids("The capital of France is")
    text = "".join(session.complete(ids, Sampler(SamplingOptions(temperature=0)), 12))
    stats = GenerationStats()
    plain = list(generate(smollm.model, smollm.model.new_cache(128, ring=True), ids,
                          Sampler(SamplingOptions(temperature=0)), 12, smollm.tokenizer.vocab.end_of_generation, stats,
                          pin=1))
    assert session.stats.tokens == plain and text == smollm.tokenizer.decode(plain)
    assert session.stats.prompt_tokens == len(ids) and session.stats.time_to_first_token_s > 0
    assert session.cache.pinned == 1  # the sink token, by the one pinned-prefix rule


def test_a_stop_string_ends_the_completion(smollm):
    session = Session.new(smollm, 128)
    ids = session.prompt_ids("The capital of France is")
    text = "".join(session.complete(ids, Sampler(SamplingOptions(temperature=0)), 40, stops=["Paris"]))
    assert session.stats.stop_reason == "reverse_prompt" and text.rstrip(" .").endswith("Paris")


def test_prompts_become_tokens_as_llama_cpp_makes_them(smollm):
    session = Session.new(smollm, 64)
    assert session.prompt_ids("") == [smollm.tokenizer.vocab.bos_id]
    with_system = session.prompt_ids("Hi", system="Be brief.")
    assert smollm.tokenizer.decode(with_system, render_special=True).startswith("<|im_start|>system\nBe brief.")
    ring = smollm.model.new_cache(64, ring=True)
    assert ring_pin(5, ring) == 1 and ring_pin(1, ring) == 0
    assert ring_pin(5, smollm.model.new_cache(64)) == 0  # no ring: nothing to pin
    with pytest.raises(PromptError):
        vocab = smollm.tokenizer.vocab
        bos, vocab.bos_id = vocab.bos_id, -1
        try:
            session.prompt_ids("")
        finally:
            vocab.bos_id = bos


def test_a_prompt_longer_than_the_ring_keeps_its_start_and_end(smollm):
    session = Session.new(smollm, 32)
    ids = list(range(100, 160))
    kept = session.fit(ids, n_predict=8)
    assert kept[:1] == ids[:1] and kept[1:] == ids[-len(kept) + 1:] and len(kept) == 32 - 8
    assert "60 tokens" in session.notices[0]


@pytest.mark.parametrize("options", [SamplingOptions(temperature=0), SamplingOptions(seed=3),
                                     SamplingOptions(temperature=1.5, top_k=0, top_p=0.5, min_p=0, seed=4)])
def test_the_sampler_says_what_it_drew_from(options):
    logits = np.random.default_rng(0).normal(0, 3, 500).astype(np.float32)
    choice = Sampler(options).choose(logits, [])
    assert choice.token in choice.ids and np.isclose(np.exp(choice.logprobs).sum(), 1.0)
    model_logprobs = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert np.isclose(choice.model_logprob(), model_logprobs[choice.token])
    if options.temperature <= 0:
        assert list(choice.ids) == [int(np.argmax(logits))]
    assert Sampler(options).sample(logits, []) == choice.token
