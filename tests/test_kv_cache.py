"""The KV cache's memory interface: truncate (rewind) and snapshot / restore, in memory and on
disk, on both backends; the ring included."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runner.engine.kv_state import KVState, KVStateError
from runner.engine.load import LoadOptions, load_model

TEXT = (Path(__file__).parent / "data" / "ppl_text.txt").read_text()


@pytest.fixture(scope="module")
def ids(smollm):
    return smollm.tokenizer.encode(TEXT)


def _steps(lm, cache, tokens):
    """Logits of one-token steps over tokens (recorded and replayed where the backend does)."""
    return np.array([lm.model.forward([t], cache) for t in tokens])


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_truncate_is_as_if_the_tokens_were_never_added(smollm_path, ids, kv_type):
    lm = load_model(smollm_path, LoadOptions(kv_type=kv_type))
    cache = lm.model.new_cache(128)
    lm.model.forward(ids[:20], cache)
    _steps(lm, cache, ids[20:26])  # drafts, rejected
    cache.truncate(20)
    assert cache.used == 20 and (cache.positions[("global", 128)] < 20).all()
    got = np.concatenate([lm.model.forward(ids[40:45], cache, all_logits=True), _steps(lm, cache, ids[45:50])])

    fresh = lm.model.new_cache(128)
    lm.model.forward(ids[:20], fresh)
    want = np.concatenate([lm.model.forward(ids[40:45], fresh, all_logits=True), _steps(lm, fresh, ids[45:50])])
    assert np.array_equal(got, want)


def test_truncate_inside_a_wrapped_ring_forgets_only_the_dropped_tokens(smollm, ids):
    """After the wrap, the dropped tokens took the slots of the oldest ring tokens: those stay lost,
    everything else is as it was, and the pinned keys move back to the shift of the shorter cache."""
    n_ctx, m = 24, smollm.model
    cache = m.new_cache(n_ctx, ring=True)
    m.forward(ids[:4], cache)
    cache.pin()
    _steps(smollm, cache, ids[4:50])
    before = cache.snapshot()
    _steps(smollm, cache, ids[50:55])  # drafts, rejected
    dropped_slots = np.flatnonzero(cache.positions[("global", n_ctx)] >= 50)
    assert cache.shift > 0 and len(dropped_slots) == 5
    cache.truncate(50)

    reference = m.new_cache(n_ctx, ring=True)
    reference.restore(before)
    reference.positions[("global", n_ctx)][dropped_slots] = -1  # what the dropped tokens overwrote
    assert np.array_equal(cache.positions[("global", n_ctx)], reference.positions[("global", n_ctx)])
    assert np.array_equal(_steps(smollm, cache, ids[60:66]), _steps(smollm, reference, ids[60:66]))


def test_truncate_after_the_ring_wrapped_rotates_pinned_keys_back(smollm, ids):
    n_ctx, m = 24, smollm.model
    cache = m.new_cache(n_ctx, ring=True)
    m.forward(ids[:4], cache)
    cache.pin()
    as_written = cache.snapshot().pinned_keys[0]
    _steps(smollm, cache, ids[4:40])
    assert cache.shift > 0
    cache.truncate(20)  # shorter than the context: no shift
    assert cache.shift == 0 and cache.rotates_pinned
    _steps(smollm, cache, ids[40:41])
    assert not cache.rotates_pinned
    assert np.allclose(smollm.backend.read_kv(cache.keys[0], cache.values[0], 4)[0], as_written, atol=1e-6)


def test_truncate_into_the_pinned_prefix_shortens_it(smollm, ids):
    m = smollm.model
    cache = m.new_cache(32, ring=True)
    m.forward(ids[:6], cache)
    cache.pin()
    _steps(smollm, cache, ids[6:40])  # wrapped: the pinned keys sit at a shift
    cache.truncate(3)
    assert cache.pinned == 3 and cache.used == 3
    fresh = m.new_cache(32, ring=True)
    m.forward(ids[:3], fresh)
    fresh.pin()
    assert np.array_equal(_steps(smollm, cache, ids[10:50]), _steps(smollm, fresh, ids[10:50]))
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(cache.used + 1)


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
def test_snapshot_restores_in_memory_and_from_disk(smollm_path, ids, tmp_path, device):
    if device == "torch-cpu":
        pytest.importorskip("torch")
    lm = load_model(smollm_path, LoadOptions(device=device, kv_type="q8_0"))
    cache = lm.model.new_cache(64, ring=True)
    lm.model.forward(ids[:3], cache)
    cache.pin()
    lm.model.forward(ids[3:40], cache)
    state = cache.snapshot(note={"model": "smollm"})
    state.save(tmp_path / "kv.npz")
    want = np.asarray(_steps(lm, cache, ids[40:70]))  # wraps the ring on the way
    for restored in (state, KVState.load(tmp_path / "kv.npz", cache)):
        cache.restore(restored)
        assert np.array_equal(np.asarray(_steps(lm, cache, ids[40:70])), want)
    other = lm.model.new_cache(64, ring=True)  # a fresh cache takes it too
    other.restore(KVState.load(tmp_path / "kv.npz", other))
    assert np.array_equal(np.asarray(_steps(lm, other, ids[40:70])), want)
    assert KVState.load(tmp_path / "kv.npz", other).note == {"model": "smollm"}


def test_snapshot_moves_between_backends_exactly(smollm_path, ids):
    """One layout on every backend: the CPU's tiled q8_0 keys, exported, imported by torch and
    exported again are the same bytes; and torch decodes on from them."""
    pytest.importorskip("torch")
    cpu, gpu = load_model(smollm_path, LoadOptions(kv_type="q8_0")), load_model(smollm_path, LoadOptions(device="torch-cpu", kv_type="q8_0"))
    cache = cpu.model.new_cache(100)
    cpu.model.forward(ids[:37], cache)
    state = cache.snapshot()
    moved = gpu.model.new_cache(100)
    moved.restore(state)
    again = moved.snapshot()
    assert all(np.array_equal(a, b) for a, b in zip(state.keys + state.values, again.keys + again.values))
    fresh = gpu.model.new_cache(100)
    gpu.model.forward(ids[:37], fresh)
    got, want = (np.asarray(gpu.model.forward(ids[37:40], c)) for c in (moved, fresh))
    assert np.argmax(got) == np.argmax(want)


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(smollm, ids, tmp_path):
    m = smollm.model
    cache = m.new_cache(64)
    m.forward(ids[:10], cache)
    state = cache.snapshot()
    target = m.new_cache(128)
    m.forward(ids[:5], target)
    before = target.snapshot()
    with pytest.raises(KVStateError, match="another cache: n_ctx 64 \\(here 128\\)"):
        target.restore(state)
    state = cache.snapshot()
    state.keys[3] = state.keys[3][:, :5]
    with pytest.raises(KVStateError, match="keys_3"):
        cache.restore(state)
    assert target.used == 5 and np.array_equal(target.snapshot().keys[0], before.keys[0])

    bad = tmp_path / "bad.npz"
    for content in (b"", b"PK\x03\x04 not a zip", b"\x93NUMPY"):
        bad.write_bytes(content)
        with pytest.raises(KVStateError, match="is not a KV cache state"):
            KVState.load(bad, cache)
    np.savez(bad, header=np.array('{"format": "ggrun-kv/1"}'))
    with pytest.raises(KVStateError, match="is not a KV cache state"):
        KVState.load(bad, cache)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_an_empty_cache_snapshots_and_restores(smollm_path, kv_type):
    lm = load_model(smollm_path, LoadOptions(kv_type=kv_type))
    empty = lm.model.new_cache(64, ring=True).snapshot()
    cache = lm.model.new_cache(64, ring=True)
    lm.model.forward([1, 2, 3], cache)
    cache.restore(empty)
    assert cache.used == 0 and (cache.positions[("global", 64)] == -1).all()
