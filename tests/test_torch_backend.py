"""Whole models on the torch backend against the Numba backend, device choice and memory checks.

Runs on torch's CPU device ("torch-cpu") unless GGRUN_TEST_DEVICE=cuda (scripts/gpu_check).
"""
from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from runner.engine import backend as backend_module
from runner.engine.backend import BackendError, make_backend, resolve_device
from runner.engine.load import LoadOptions, load_model
from runner.engine.memory_fit import MemoryFitError
from runner.measure.perplexity import perplexity
from runner.terminal.cli import main

torch = pytest.importorskip("torch")
from kernels_gpu.backend import TorchBackend  # noqa: E402

DEVICE = {"cpu": "torch-cpu"}.get(os.environ.get("GGRUN_TEST_DEVICE", "cpu"), os.environ.get("GGRUN_TEST_DEVICE"))
TEXT = (Path(__file__).parent / "data" / "ppl_text.txt").read_text()
PROMPT = "The history of the printing press begins"


# Logit gap under which the two backends may rank the top two tokens either way: their logits
# differ by a few 1e-3 (the Numba products take 16-bit activations, torch's float32 ones).
NEAR_TIE = 0.02


def _greedy(lm, ids, n):
    """n greedy tokens after ids, each with the gap between its logit and the runner-up's."""
    cache = lm.model.new_cache(len(ids) + n + 1)
    logits = lm.model.forward(ids, cache)
    out, gaps = [], []
    for _ in range(n):
        second, first = np.partition(logits, -2)[-2:]
        out.append(int(np.argmax(logits)))
        gaps.append(float(first - second))
        logits = lm.model.forward([out[-1]], cache)
    return out, gaps


def _assert_same_greedy(got, want):
    """The same tokens up to the end, or up to a step where the reference's top two nearly tie
    (the texts may part there, and are not comparable after)."""
    (tokens, _), (reference, gaps) = got, want
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"token {i}: {a} against {b}, {gaps[i]:.3f} ahead of the runner-up"
            return


@pytest.fixture(scope="module", params=["smollm_path", "gemma_path"])
def both_backends(request):
    path = request.getfixturevalue(request.param)
    return load_model(path, LoadOptions(kv_type="f32", precise=True)), load_model(path, LoadOptions(kv_type="f32", device=DEVICE))


def test_64_greedy_tokens_match_the_cpu_backend(both_backends):
    cpu, gpu = both_backends
    ids = cpu.tokenizer.encode(PROMPT)
    _assert_same_greedy(_greedy(gpu, ids, 64), _greedy(cpu, ids, 64))


def test_perplexity_within_half_a_percent(both_backends):
    cpu, gpu = both_backends
    text = TEXT[:3000]
    want = perplexity(cpu, text, 128, progress=False).ppl
    got = perplexity(gpu, text, 128, progress=False).ppl
    assert abs(got / want - 1) < 0.005


def test_replayed_steps_match_eager_steps_across_slot_buckets(both_backends):
    """The one-token step with static, padded inputs (CUDA graphs on cuda; the same bookkeeping
    run eagerly on the CPU) gives the logits of the plain step, while the context crosses the
    256-slot bucket and, for Gemma, its sliding layers' ring."""
    _, lm = both_backends
    ids = lm.tokenizer.encode(TEXT)[:250]
    results = []
    for graphs in (False, True):
        be = TorchBackend(lm.backend.device.type, graphs=graphs)
        lm.model.backend, saved = be, lm.model.backend
        try:
            cache = lm.model.new_cache(300)
            logits = [lm.model.forward(ids, cache)]
            for t in range(12):
                logits.append(lm.model.forward([int(np.argmax(logits[-1]))], cache))
            results.append(np.array(logits))
            assert (len(be.step_graphs.get(cache, {}).get((1, False), {})) == 2) == graphs  # buckets of 256 and 300 slots
            del cache
            gc.collect()
            assert not be.step_graphs  # (a cache's graphs go with it)
        finally:
            lm.model.backend = saved
    assert np.allclose(results[0], results[1], atol=1e-4)


def test_compiled_decode_products_match_the_cpu_backend(both_backends):
    """The decode products torch.compile builds (what CUDA runs, as Triton), here compiled for
    the CPU: every tensor type and shape of the real models traces whole and computes right."""
    cpu, lm = both_backends
    ids = cpu.tokenizer.encode(PROMPT)
    saved, lm.model.backend = lm.model.backend, TorchBackend(lm.backend.device.type, compiled=True)
    try:
        _assert_same_greedy(_greedy(lm, ids, 12), _greedy(cpu, ids, 12))
    finally:
        lm.model.backend = saved


def test_ring_with_pinned_keys_matches_the_cpu_backend(both_backends):
    cpu, gpu = both_backends
    ids = cpu.tokenizer.encode(TEXT)[:60]
    out = []
    for lm in (cpu, gpu):
        cache = lm.model.new_cache(24, ring=True)
        lm.model.forward(ids[:4], cache)
        cache.pin()
        lm.model.forward(ids[4:20], cache)
        out.append([lm.model.forward([t], cache) for t in ids[20:]])  # wraps the ring twice
    assert np.allclose(out[0], out[1], atol=2e-3 * np.abs(out[0]).max())


@pytest.mark.parametrize("graphs", [False, True])
def test_q8_0_cache_matches_the_cpu_backend(smollm_path, graphs):
    """Both backends quantize the q8_0 cache alike (llama.cpp's rounding), eagerly and through
    the padded one-token step of CUDA graphs."""
    cpu = load_model(smollm_path, LoadOptions(kv_type="q8_0", precise=True))
    gpu = load_model(smollm_path, LoadOptions(device=DEVICE, kv_type="q8_0"))
    gpu.model.backend = TorchBackend(gpu.backend.device.type, graphs=graphs)
    assert gpu.model.new_cache(8).keys[0].dtype == torch.int8
    ids = cpu.tokenizer.encode(PROMPT)
    _assert_same_greedy(_greedy(gpu, ids, 24), _greedy(cpu, ids, 24))


def test_cuda_when_absent_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendError, match="CUDA is not available"):
        make_backend("cuda")
    result = CliRunner().invoke(main, ["run", "-p", "hi", "-n", "1", "--device", "cuda"])
    assert result.exit_code == 1 and "error: --device cuda: CUDA is not available" in result.output
    monkeypatch.setattr(backend_module, "_nvidia_driver_present", lambda: True)
    assert resolve_device("auto") == "cpu"  # a driver but no CUDA in this torch: the Numba backend


def test_auto_does_not_import_torch_without_a_driver(monkeypatch):
    monkeypatch.setattr(backend_module, "_nvidia_driver_present", lambda: False)
    monkeypatch.setattr(backend_module.importlib.util, "find_spec", lambda name: pytest.fail("looked for torch"))
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cuda") == "cuda"


def test_a_model_too_big_for_the_device_says_what_it_needs(smollm_path, monkeypatch):
    monkeypatch.setattr(TorchBackend, "free_memory", lambda self: 100 * 2**20)
    with pytest.raises(MemoryFitError, match=r"needs weights 0\.09 GiB \+ f16 KV cache 0\.0[0-9] GiB at context "
                                             r"2048, but 0\.10 GiB are free on torch-cpu: the longest context that "
                                             r"fits is (\d+) tokens") as refused:
        load_model(smollm_path, LoadOptions(device="torch-cpu", kv_type="f16", n_ctx=2048))
    best = int(re.search(r"fits is (\d+)", str(refused.value))[1])
    assert 16 <= best < 2048
    load_model(smollm_path, LoadOptions(device="torch-cpu", kv_type="f16", n_ctx=best))


def test_weights_stay_quantized_on_the_device(smollm_path):
    lm = load_model(smollm_path, LoadOptions(kv_type="f32", device=DEVICE))
    layer = lm.model.layers[0]
    w = layer.ffn.gate
    assert w.raw.dtype == torch.uint8
    f = lm.file
    assert w.raw.numel() == f.tensors["blk.0.ffn_gate.weight"].nbytes  # ~4.5 bits per weight, as in the file
