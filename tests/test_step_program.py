"""Decode steps replayed from a recorded program (kernels_cpu/step_program.py) compute exactly
what the same steps compute eagerly, operation by operation."""
from __future__ import annotations

import gc
import inspect
import re
import weakref

import numpy as np
import pytest

from convert.convert import convert_hf
from runner.engine.load import LoadOptions, load_model

from .hf_folders import RANDOM_ARCHS


def _decode(lm, prompt, n, replay, chunk=1, **cache_args):
    """Logits of the prompt's last token and of n greedy passes after it, each of `chunk` tokens
    (the greedy one and those after it in the vocabulary: a verified draft's shape) with the
    logits of all of them where chunk > 1; and the cache."""
    cache = lm.model.new_cache(**cache_args)
    lm.backend.record_steps = replay
    try:
        logits = [lm.model.forward(prompt, cache)[None]]
        for _ in range(n):
            token = int(np.argmax(logits[-1][-1]))
            tokens = [(token + j) % lm.params.vocab_size for j in range(chunk)]
            logits.append(lm.model.forward(tokens, cache, all_logits=True) if chunk > 1
                          else lm.model.forward(tokens, cache)[None])
            if cache_args.get("ring") and cache.pinned == 0 and cache.used > 8:
                cache.pin()  # (so that the pinned keys move at every step once the ring wraps)
    finally:
        lm.backend.record_steps = True
    return logits, cache


def _program(lm, chunk=1):
    """The model's recorded program of passes of `chunk` tokens (with all their logits where more
    than one), None where they do not replay."""
    return lm.backend.recorded_program(lm.model, lm.model.kv_type, chunk, chunk > 1)


def _assert_replay_is_exact(lm, prompt, n, replayable=True, chunk=1, **cache_args):
    eager, _ = _decode(lm, prompt, n, replay=False, chunk=chunk, **cache_args)
    replayed, _ = _decode(lm, prompt, n, replay=True, chunk=chunk, **cache_args)
    program = _program(lm, chunk)
    assert (program is not None) == replayable
    assert all(np.array_equal(a, b) for a, b in zip(replayed, eager))
    if replayable and lm.model.params.n_expert == 0:  # (a dense model's replay compiles no expert kernels)
        assert program.mixture.dtype.names == ("dense",)


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
def test_smollm_replays_exactly(smollm_path, kv_type):
    lm = load_model(smollm_path, LoadOptions(kv_type=kv_type))
    _assert_replay_is_exact(lm, [1, 504, 3458, 314], 24, n_ctx=64)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_gemma_replays_exactly_past_the_sliding_window(gemma_path, kv_type):
    lm = load_model(gemma_path, LoadOptions(kv_type=kv_type))
    window = lm.params.sliding_window
    prompt = np.random.default_rng(0).integers(0, lm.params.vocab_size, window + 4).tolist()
    _assert_replay_is_exact(lm, prompt, 12, n_ctx=window + 32)


def test_ring_steps_replay_after_the_ring_wraps(smollm, monkeypatch):
    """Past the wrap the host moves the pinned keys before each step, and the step replays."""
    import kernels_cpu.backend as cpu_backend
    replayed, run_step = [], cpu_backend.run_step

    def counted(backend, compute, batch, *args):
        replayed.append(int(batch.positions[0]))
        return run_step(backend, compute, batch, *args)
    monkeypatch.setattr(cpu_backend, "run_step", counted)
    _assert_replay_is_exact(smollm, [1, 504, 3458, 314], 60, n_ctx=32, ring=True)
    assert sorted(p for p in replayed if p >= 32) == list(range(32, 64))


@pytest.mark.parametrize("chunk", [1, 5], ids=["steps", "passes of 5 tokens"])
@pytest.mark.parametrize("arch", RANDOM_ARCHS)
def test_every_architecture_replays_exactly(random_models, tmp_path, arch, chunk):
    """One-token steps, and passes of a few tokens with the logits of each (a verified draft)."""
    out = tmp_path / f"{arch}-q8.gguf"
    convert_hf(random_models[arch], out, "Q8_0", progress=False)
    _assert_replay_is_exact(load_model(out, LoadOptions(kv_type="f32")), [1, 2, 3], 8 if chunk == 1 else 4, chunk=chunk, n_ctx=48)


@pytest.mark.parametrize("outtype", ["F32", "F16", "BF16"])
def test_float_weights_replay_exactly(random_models, tmp_path, outtype):
    out = tmp_path / f"llama-{outtype}.gguf"
    convert_hf(random_models["llama"], out, outtype, progress=False)
    _assert_replay_is_exact(load_model(out, LoadOptions(kv_type="f32")), [1, 2, 3], 8, n_ctx=32)


@pytest.mark.parametrize("chunk", [1, 5], ids=["steps", "passes of 5 tokens"])
def test_one_recording_replays_over_every_cache_of_the_model(smollm_path, chunk):
    """A pass recorded over one cache replays over the model's later caches, of other sizes too,
    bound to their buffers (also where the recording's cache is gone), as they compute eagerly."""
    lm = load_model(smollm_path, LoadOptions(kv_type="f32"))
    prompt = [1, 504, 3458, 314]
    n = 6 if chunk == 1 else 4
    _, first = _decode(lm, prompt, 3, replay=True, chunk=chunk, n_ctx=32)
    program = _program(lm, chunk)
    del first
    gc.collect()
    for n_ctx in (64, 32):
        eager, _ = _decode(lm, prompt, n, replay=False, chunk=chunk, n_ctx=n_ctx)
        replayed, _ = _decode(lm, prompt, n, replay=True, chunk=chunk, n_ctx=n_ctx)
        assert _program(lm, chunk) is program  # (not recorded again)
        assert all(np.array_equal(a, b) for a, b in zip(replayed, eager))


def test_a_model_s_programs_go_with_it(smollm_path):
    """The backend keeps programs by their model, weakly: a model let go is freed, programs and all."""
    lm = load_model(smollm_path, LoadOptions(kv_type="f32"))
    _decode(lm, [1, 504], 3, replay=True, n_ctx=16)
    assert _program(lm) is not None
    backend, model = lm.backend, weakref.ref(lm.model)
    del lm
    gc.collect()
    assert model() is None and not backend._programs


def test_replay_rejects_token_ids_outside_the_vocabulary(smollm):
    cache = smollm.model.new_cache(16)
    smollm.model.forward([1, 2], cache)
    smollm.model.forward([3], cache)  # recorded
    with pytest.raises(IndexError):
        smollm.model.forward([smollm.params.vocab_size], cache)


# Layer 0's output scaled by a factor read from the activation's values into Python: the
# pattern of an expert choice (the factor of the first step would otherwise be replayed forever).
DATA_DEPENDENT = {
    "float": lambda y: 1 + 0.5 * np.tanh(float(y[0, 0])),
    "int": lambda y: 1 + 0.1 * int(y[0, 0] > 0),
    "bool": lambda y: 1.5 if y[0, 0] > 0 else 0.5,
    "item": lambda y: 1 + 0.5 * np.tanh(y[0, :1].item()),
    "argmax": lambda y: 1 + 0.01 * int(np.argmax(y[0])),
    "argmax method": lambda y: 1 + 0.01 * y[0].argmax(),
    "index by a value": lambda y: 1 + 0.5 * np.tanh(np.float32(np.arange(8)[(y[:, 0] > 0).astype(np.int64)][0])),
}


@pytest.mark.parametrize("read", list(DATA_DEPENDENT))
def test_a_step_that_reads_activation_values_is_not_replayed(smollm_path, monkeypatch, read):
    lm = load_model(smollm_path, LoadOptions(kv_type="f32"))
    block = lm.model.block

    def scaled_block(layer, x, batch, cache, i):
        y = block(layer, x, batch, cache, i)
        return y * np.float32(DATA_DEPENDENT[read](y)) if i == 0 else y

    monkeypatch.setattr(lm.model, "block", scaled_block)
    cache = lm.model.new_cache(32)
    lm.model.forward([1, 504], cache)
    lm.model.forward([3458], cache)
    assert _program(lm) is None  # refused by the recorder itself, before any replay
    _assert_replay_is_exact(lm, [1, 504, 3458, 314], 6, replayable=False, n_ctx=32)


def test_a_read_the_tracing_cannot_see_is_caught_by_the_first_replay(smollm_path, monkeypatch):
    """np.asarray hands out a plain copy of an activation: its reads are invisible to the
    recorder; the first replay, checked against an eager step, drops the program."""
    lm = load_model(smollm_path, LoadOptions(kv_type="f32"))
    block = lm.model.block

    def scaled_block(layer, x, batch, cache, i):
        y = block(layer, x, batch, cache, i)
        return y * np.float32(1 + 0.5 * np.tanh(float(np.asarray(y)[0, 0]))) if i == 0 else y

    monkeypatch.setattr(lm.model, "block", scaled_block)
    cache = lm.model.new_cache(32)
    lm.model.forward([1, 504], cache)
    lm.model.forward([3458], cache)
    assert _program(lm) is not None  # recorded: the read was not seen
    eager, _ = _decode(lm, [1, 504, 3458, 314], 6, replay=False, n_ctx=32)
    replayed, _ = _decode(lm, [1, 504, 3458, 314], 6, replay=True, n_ctx=32)
    assert _program(lm) is None and np.array_equal(replayed, eager)


def test_program_rows_take_named_operands_of_their_kind(smollm):
    from kernels_cpu.step_program import Op, Recorder
    cache = smollm.model.new_cache(8)
    recorder = Recorder(cache.reserve([1]), smollm.backend.constants, precise=False, cache_keys=cache.keys)
    x = recorder.traced(np.zeros((1, 4), np.float32))
    out = recorder.traced(np.zeros((1, 4), np.float32))
    recorder.add(Op.ADD, a=recorder.address(x, 4), b=recorder.address(x, 4), out=recorder.address(out, 4), n=4, width=4)
    with pytest.raises(TypeError, match="ADD takes a, b, out, n"):
        recorder.add(Op.ADD, x=recorder.address(x, 4), out=recorder.address(out, 4), n=4)
    with pytest.raises(TypeError, match="ADD's b = .* is not the address of float32 memory"):
        recorder.add(Op.ADD, a=recorder.address(x, 4), b=12345, out=recorder.address(out, 4), n=4, width=4)
    with pytest.raises(TypeError, match="EMBED's ids = 7 is not one of the step's inputs"):
        recorder.add(Op.EMBED, matrix=recorder.matrix(smollm.model.tok_embd), ids=7, out=recorder.address(out, 4),
                     width=4)
    assert recorder.failed is None and len(recorder.rows) == 1


def test_every_operation_is_declared_replayed_and_recorded():
    """Each Op has its operands (OPERANDS), a branch in the replay (run_program's, or the mixture's
    or the recurrent layers' operations it calls, which are MIXTURE_OPS and RECURRENT_OPS) and a
    Recorder method that writes it."""
    from kernels_cpu import step_program as sp
    mixture, recurrent = inspect.getsource(sp._mixture_op_impl), inspect.getsource(sp._recurrent_op_impl)
    replay = inspect.getsource(sp.run_program.py_func) + mixture + recurrent
    recorder = [inspect.getsource(f) for _, f in inspect.getmembers(sp.Recorder, inspect.isfunction)]
    for op in sp.Op:
        assert op in sp.OPERANDS, f"{op.name} has no operands"
        assert re.search(rf"op == Op\.{op.name}\b", replay), f"{op.name} is not replayed"
        assert any(re.search(rf"\bOp\.{op.name}\b", source) for source in recorder), f"no Recorder method writes {op.name}"
    assert {op for op in sp.Op if re.search(rf"op == Op\.{op.name}\b", mixture)} == set(sp.MIXTURE_OPS)
    assert {op for op in sp.Op if re.search(rf"op == Op\.{op.name}\b", recurrent)} == set(sp.RECURRENT_OPS)
