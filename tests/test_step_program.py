"""Decode steps replayed from a recorded program (kernels_cpu/step_program.py) compute exactly
what the same steps compute eagerly, operation by operation."""
from __future__ import annotations

import numpy as np
import pytest

from convert.convert import convert_hf
from kernels_cpu.step_program import REPLAY_KEY
from runner.load import load_model


def _decode(lm, prompt, n, replay, **cache_args):
    """Logits of the prompt's last token and of n greedy steps after it; and the cache."""
    cache = lm.model.new_cache(**cache_args)
    if not replay:
        cache.replays = None  # every step eager
    logits = [lm.model.forward(prompt, cache)]
    for _ in range(n):
        logits.append(lm.model.forward([int(np.argmax(logits[-1]))], cache))
        if cache_args.get("ring") and cache.pinned == 0 and cache.used > 8:
            cache.pin()  # (pinned keys move once the ring wraps: those steps run eagerly)
    return np.array(logits), cache


def _assert_replay_is_exact(lm, prompt, n, replayable=True, **cache_args):
    eager, _ = _decode(lm, prompt, n, replay=False, **cache_args)
    replayed, cache = _decode(lm, prompt, n, replay=True, **cache_args)
    assert (cache.replays[REPLAY_KEY] is not None) == replayable
    assert np.array_equal(replayed, eager)


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
def test_smollm_replays_exactly(smollm_path, kv_type):
    lm = load_model(smollm_path, kv_type=kv_type)
    _assert_replay_is_exact(lm, [1, 504, 3458, 314], 24, n_ctx=64)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_gemma_replays_exactly_past_the_sliding_window(gemma_path, kv_type):
    lm = load_model(gemma_path, kv_type=kv_type)
    window = lm.params.sliding_window
    prompt = np.random.default_rng(0).integers(0, lm.params.vocab_size, window + 4).tolist()
    _assert_replay_is_exact(lm, prompt, 12, n_ctx=window + 32)


def test_ring_steps_replay_until_pinned_keys_move(smollm):
    _assert_replay_is_exact(smollm, [1, 504, 3458, 314], 60, n_ctx=32, ring=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_architecture_replays_exactly(random_models, tmp_path, arch):
    out = tmp_path / f"{arch}-q8.gguf"
    convert_hf(random_models[arch], out, "Q8_0", progress=False)
    _assert_replay_is_exact(load_model(out), [1, 2, 3], 8, n_ctx=32)


@pytest.mark.parametrize("outtype", ["F32", "F16", "BF16"])
def test_float_weights_replay_exactly(random_models, tmp_path, outtype):
    out = tmp_path / f"llama-{outtype}.gguf"
    convert_hf(random_models["llama"], out, outtype, progress=False)
    _assert_replay_is_exact(load_model(out), [1, 2, 3], 8, n_ctx=32)


def test_replay_rejects_token_ids_outside_the_vocabulary(smollm):
    cache = smollm.model.new_cache(16)
    smollm.model.forward([1, 2], cache)
    smollm.model.forward([3], cache)  # recorded
    with pytest.raises(IndexError):
        smollm.model.forward([smollm.params.vocab_size], cache)
