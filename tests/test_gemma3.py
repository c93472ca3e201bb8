"""Gemma 3 270M (Q4_K_M mix) against transformers running the same GGUF in fp32."""
import json
import subprocess
import sys

import numpy as np
import pytest

from .conftest import hf_logits_function
from .hard_strings import BASE


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """On the precise path: these tests compare decode steps with transformers' fp32 argmax, which
    8-bit activations may flip at near-ties (they are judged in test_fast_decode.py)."""
    from runner.engine.load import LoadOptions, load_model
    return load_model(gemma_path, LoadOptions(kv_type="f32", precise=True))


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return hf_logits_function(gemma_path)


@pytest.fixture(scope="module")
def long_ids(gemma):
    text = " ".join(s for s in BASE if s.strip()) * 4
    ids = gemma.tokenizer.encode(text)
    assert len(ids) > 700
    return ids[:700]


def _compare(got, want):
    assert got.shape == want.shape
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
    assert np.abs(got - want).max() < 0.01 * np.abs(want).max()


def test_file_is_the_k_quant_mix(gemma):
    types = {t.type.name for t in gemma.file.tensors.values()}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types
    p = gemma.params
    assert (p.arch, p.n_embd, p.head_dim, p.n_head, p.n_head_kv, p.sliding_window) == ("gemma3", 640, 256, 4, 1, 512)


def test_short_prompt_logits_match_transformers(gemma, hf_gemma, long_ids):
    ids = long_ids[:80]
    _compare(gemma.model.forward(ids, gemma.model.new_cache(128), all_logits=True), hf_gemma(ids))


def test_long_prompt_past_the_sliding_window(gemma, hf_gemma, long_ids):
    want = hf_gemma(long_ids)
    got = gemma.model.forward(long_ids, gemma.model.new_cache(1024), all_logits=True)
    _compare(got, want)
    # the window matters: attending to everything gives different logits past position 512
    sliding = [layer.attn for layer in gemma.model.layers if layer.attn.window]
    assert len(sliding) == 15 and all(a.window == 512 and a.rope_base == 10000.0 for a in sliding)
    try:
        for a in sliding:
            a.window = 0
        unwindowed = gemma.model.forward(long_ids, gemma.model.new_cache(1024), all_logits=True)
    finally:
        for a in sliding:
            a.window = 512
    assert np.abs(unwindowed[600:] - want[600:]).max() > 100 * np.abs(got[600:] - want[600:]).max()


def test_decoding_through_the_ring_matches(gemma, hf_gemma, long_ids):
    """Prefill, then decode one token at a time past the window: sliding layers reuse their slots."""
    want = hf_gemma(long_ids)
    cache = gemma.model.new_cache(1024)
    gemma.model.forward(long_ids[:500], cache)
    for i in range(500, 540):
        got = gemma.model.forward([long_ids[i]], cache)
        assert got.argmax() == want[i].argmax()
    assert max(cache.capacity) == 1024 and min(cache.capacity) == 512 + 512


def test_run_completes_sensibly(gemma_path):
    r = subprocess.run([sys.executable, "-m", "runner", "run", "gemma3-270m", "--temp", "0", "-n", "16", "--json",
                        "-p", "The capital of France is"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    text = json.loads(r.stdout)["text"]
    assert "France" in text or "Paris" in text
