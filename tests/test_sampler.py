"""Sampling filters on hand-made distributions."""
import numpy as np

from runner.engine.sampler import Sampler, SamplingOptions

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def _draws(n=400, **kw):
    s = Sampler(SamplingOptions(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "seed": 3, **kw}))
    return {s.sample(LOGITS, []) for _ in range(n)}


def test_greedy():
    assert Sampler(SamplingOptions(temperature=0)).sample(LOGITS, []) == 0


def test_filters():
    assert _draws() == {0, 1, 2, 3}
    assert _draws(top_k=2) == {0, 1}
    assert _draws(top_p=0.7) == {0, 1}
    assert _draws(min_p=0.35) == {0, 1}


def test_repeat_penalty_pushes_away_from_recent_tokens():
    s = Sampler(SamplingOptions(temperature=0, repeat_penalty=100.0, repeat_last_n=2))
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    assert s.sample(logits, [0]) == 1
    assert s.sample(logits, [0, 2, 1]) == 0  # 0 has left the window of the last two tokens


def test_same_seed_same_choices():
    a = Sampler(SamplingOptions(seed=7, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))
    b = Sampler(SamplingOptions(seed=7, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))
    assert [a.sample(LOGITS, []) for _ in range(50)] == [b.sample(LOGITS, []) for _ in range(50)]


def test_frequency_and_presence_penalties_as_llama_cpp_applies_them():
    """logit - count * frequency - (count > 0) * presence, over the last repeat_last_n tokens."""
    logits = np.array([2.0, 1.5, 1.0], dtype=np.float32)
    freq = Sampler(SamplingOptions(temperature=0, frequency_penalty=0.3, repeat_last_n=8))
    assert freq.sample(logits, [0]) == 0 and freq.sample(logits, [0, 0]) == 1  # 2.0 - 0.6 < 1.5
    presence = Sampler(SamplingOptions(temperature=0, presence_penalty=0.6, repeat_last_n=8))
    assert presence.sample(logits, [0]) == presence.sample(logits, [0, 0, 0]) == 1  # 1.4 once, however often
    assert presence.sample(logits, [0, 1]) == 0  # 1.4, 0.9, 1.0
