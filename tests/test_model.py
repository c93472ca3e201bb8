"""Whole-model logits against transformers running the same GGUF in fp32 (an independent
implementation), on the precise path (the default rounds activations to 8 bits, as llama.cpp does:
its outcomes are judged in test_fast_decode.py)."""
import dataclasses

import numpy as np
import pytest

from runner.engine import load as load_module
from runner.engine.backend import BackendError

from .conftest import hf_logits_function

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
          "Within fifty years, printers in more than two hundred European cities had produced millions "
          "of books, and the cost of spreading an idea fell faster than ever before. Scholars argue")


@pytest.fixture(scope="module")
def hf_logits(smollm_path, smollm):
    ids = smollm.tokenizer.encode(PROMPT)
    return ids, hf_logits_function(smollm_path)(ids)


def test_logits_match_transformers(smollm_path, hf_logits):
    from runner.engine.load import LoadOptions, load_model
    ids, want = hf_logits
    assert len(ids) >= 64
    model = load_model(smollm_path, LoadOptions(kv_type="f32", precise=True)).model
    got = model.forward(ids, model.new_cache(256), all_logits=True)
    assert got.shape == want.shape
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_decode_steps_match_prefill(smollm_path, hf_logits):
    """Token-by-token decoding through the KV cache gives the same logits as one prefill."""
    from runner.engine.load import LoadOptions, load_model
    ids, want = hf_logits
    model = load_model(smollm_path, LoadOptions(kv_type="f32", precise=True)).model
    cache = model.new_cache(128)
    split = len(ids) - 8
    model.forward(ids[:split], cache)
    for i in range(split, len(ids)):
        got = model.forward([ids[i]], cache)
        assert got.argmax() == want[i].argmax()
        assert np.abs(got - want[i]).max() < 0.05 * np.abs(want[i]).max()


@pytest.mark.parametrize("kv_type, dtype", [("f16", np.float16), ("q8_0", np.int8)])
def test_reduced_precision_caches_stay_close(smollm_path, hf_logits, kv_type, dtype):
    """The f16 KV cache (the CLI's default, as llama.cpp's) and the q8_0 one against the same
    fp32 reference: the exact tests above use the f32 cache; rounding keys and values may flip
    near-ties. (A model of its own: the session's is shared, and stays as it is.)"""
    from runner.engine.load import LoadOptions, load_model
    ids, want = hf_logits
    model = load_model(smollm_path, LoadOptions(kv_type=kv_type, precise=True)).model
    cache = model.new_cache(256)
    got = model.forward(ids[:-8], cache, all_logits=True)
    decoded = [model.forward([t], cache) for t in ids[-8:]]
    assert cache.keys[0].dtype == dtype
    got = np.concatenate([got, decoded])
    assert np.mean(got.argmax(axis=1) == want.argmax(axis=1)) >= 0.95
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_q8_0_cache_needs_head_sizes_in_whole_blocks(smollm_path, monkeypatch):
    read = load_module.read_params
    monkeypatch.setattr(load_module, "read_params", lambda f: dataclasses.replace(read(f), head_dim=80))
    with pytest.raises(BackendError, match=r"multiples of 32; this model.s are 64/80"):
        load_module.load_model(smollm_path, load_module.LoadOptions(kv_type="q8_0"))
