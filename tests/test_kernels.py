"""Quantized products and row reads against gguf.quants dequantization (the reference decoder), on
the precise path (16-bit activations) that these tolerances describe; the default 8-bit path is
tested in test_kernels_int8.py."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gguf_io import GGUFFile
from kernels_cpu import amx
from kernels_cpu.blocks import SUPPORTED_TYPES
from kernels_cpu.matmul import load_matrix
from kernels_cpu.rowdot_float import FLOAT_BYTES

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


def _weights(rng, n, k, kind):
    if kind == "normal":
        return rng.standard_normal((n, k)).astype(np.float32)
    if kind == "extreme":  # huge and tiny magnitudes, exact zeros and constant blocks
        w = rng.standard_normal((n, k)).astype(np.float32) * 10.0 ** rng.integers(-6, 4, (n, 1))
        w[0] = 0.0
        w[1 % n] = 3.0
        w[:, :32] = 0.0
        return w.astype(np.float32)
    return rng.uniform(0, 1, (n, k)).astype(np.float32)  # all positive: exercises the mins


@pytest.fixture(params=["amx", "blas"])
def prefill_path(request, monkeypatch):
    """Prefill's products (more than a few tokens) on AMX, where this CPU has it, or on BLAS."""
    if request.param == "amx" and not amx.usable():
        pytest.skip("this CPU has no AMX")
    if request.param == "blas":
        monkeypatch.setattr(amx, "usable", lambda: False)
    return request.param


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "extreme", "positive"])
@pytest.mark.parametrize("n,k", [(1, 32), (37, 256), (130, 576)])
def test_products_match_reference_dequantization(qtype, kind, n, k, prefill_path):
    rng = np.random.default_rng(n * k + len(kind))
    raw = quantize(_weights(rng, n, k, kind), qtype).view(np.uint8).reshape(n, -1)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    m = load_matrix(qtype, raw, k)
    scale = np.abs(ref).max() + 1e-30
    for tokens in (1, 5, 20):  # one token, the few-token kernel, the BLAS tile path
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        want = x.astype(np.float64) @ ref.T
        tol = 1e-5 * scale * np.abs(x).sum(axis=1, keepdims=True) + 1e-30
        # float types multiply float32 activations on the default path too
        for precise in (True, False) if qtype in FLOAT_BYTES else (True,):
            assert np.all(np.abs(m.matmul(x, precise=precise) - want) <= tol), (qtype.name, tokens, precise)
    ids = np.array([0, n - 1, n // 2])
    assert np.allclose(m.rows(ids), ref[ids], rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("qtype", list(FLOAT_BYTES), ids=lambda t: t.name)
@pytest.mark.parametrize("k", [13, 40, 75])
def test_float_rows_of_any_length(qtype, k):
    """F32/F16/BF16 rows need not fill whole vectors: their last lanes are read masked."""
    rng = np.random.default_rng(k)
    raw = quantize(rng.standard_normal((24, k)).astype(np.float32), qtype).view(np.uint8).reshape(24, -1)
    ref = dequantize(raw.reshape(-1), qtype).reshape(24, k).astype(np.float64)
    m = load_matrix(qtype, raw, k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    assert np.allclose(m.matmul(x), x @ ref.T, rtol=1e-5, atol=1e-5 * np.abs(x @ ref.T).max())
    assert np.array_equal(m.rows(np.array([23, 0, 5])), ref[[23, 0, 5]].astype(np.float32))


# The types tested on random blocks, whose every bit pattern but the float16 scales' is a valid
# block (sub-block scales, mins and codes): byte offsets of each block's f16 scale (and min).
# IQ1_M's is split: the top nibbles of the four 16-bit words at 48, the first word's lowest.
RANDOM_BLOCK_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
                       T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ1_S: (0,), T.IQ1_M: (48,), T.IQ2_XXS: (0,),
                       T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.TQ1_0: (52,),
                       T.TQ2_0: (64,)}


def _random_blocks(rng, qtype, n, k, case):
    """Random bytes (every sub-block scale/min and quant bit pattern), finite f16 super-scales."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, block_bytes), dtype=np.uint8)
    for at in RANDOM_BLOCK_SCALES[qtype]:
        d = {"random": rng.uniform(-2, 2, (n, k // block)),
             "zero": np.zeros((n, k // block)),
             "extreme": rng.choice([65504.0, -65504.0, 6e-8, 0.0], (n, k // block))}[case]
        if qtype == T.IQ1_M:
            half = d.astype(np.float16).view(np.uint16)
            for i in range(4):
                raw[:, :, at + 2 * i + 1] = raw[:, :, at + 2 * i + 1] & 0x0F | (half >> 4 * i & 0xF) << 4
        else:
            raw[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", list(RANDOM_BLOCK_SCALES), ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "zero", "extreme"])
@pytest.mark.parametrize("n,k", [(1, 256), (29, 768)])
def test_random_block_products_match_reference(qtype, case, n, k, prefill_path):
    rng = np.random.default_rng(k + n)
    raw = _random_blocks(rng, qtype, n, k, case)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    m = load_matrix(qtype, raw, k)
    assert np.allclose(m.rows(np.arange(n)), ref, rtol=1e-6, atol=0)
    for tokens in (1, 5, 20):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        tol = 1e-5 * np.abs(ref).max() * np.abs(x).sum(axis=1, keepdims=True)
        assert np.all(np.abs(m.matmul(x, precise=True) - x.astype(np.float64) @ ref.T) <= tol + 1e-30)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "zero", "extreme"])
def test_iq4_rows_decode_exactly_as_reference(qtype, case):
    """Every code and sub-block scale (random blocks), read back as gguf.quants decodes them, to
    the bit."""
    rng = np.random.default_rng(int(qtype))
    n, k = 33, 1024
    raw = _random_blocks(rng, qtype, n, k, case)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k)
    assert np.array_equal(load_matrix(qtype, raw, k).rows(np.arange(n)), ref)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS],
                         ids=lambda t: t.name)
def test_prefill_products_span_several_tiles(qtype, prefill_path):
    """Tokens and rows in several 32 x 32 blocks of outputs (AMX's unit), neither a multiple of 32,
    and more rows than one thread's tile, against the reference."""
    rng = np.random.default_rng(int(qtype))
    n, k, tokens = 1100, 512, 70
    if qtype in RANDOM_BLOCK_SCALES:
        raw = _random_blocks(rng, qtype, n, k, "random")
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype).view(np.uint8).reshape(n, -1)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    tol = 1e-5 * np.abs(ref).max() * np.abs(x).sum(axis=1, keepdims=True)
    assert np.all(np.abs(load_matrix(qtype, raw, k).matmul(x) - x.astype(np.float64) @ ref.T) <= tol)


def test_amx_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("GGRUN_AMX", "0")
    assert amx.usable.__wrapped__() is False


@pytest.mark.parametrize("model", ["smollm_path", "gemma_path"])
def test_every_real_tensor_decodes_like_reference(model, request):
    f = GGUFFile(request.getfixturevalue(model))
    rng = np.random.default_rng(0)
    for name, t in f.tensors.items():
        if len(t.shape) != 2:
            continue
        raw = f.tensor_bytes(name)
        rows = rng.choice(t.n_rows, size=min(t.n_rows, 64), replace=False)
        m = load_matrix(t.type, raw[:max(rows) + 1], t.shape[0])
        ref = dequantize(raw[rows].reshape(-1), t.type).reshape(len(rows), t.shape[0])
        assert np.array_equal(m.rows(rows), ref), name
    # and one full product per type present in the file
    for qtype in {t.type for t in f.tensors.values() if len(t.shape) == 2}:
        name = next(n for n, t in f.tensors.items() if t.type == qtype and len(t.shape) == 2)
        t, raw = f.tensors[name], f.tensor_bytes(name)
        x = rng.standard_normal((1, t.shape[0])).astype(np.float32)
        want = x @ dequantize(raw.reshape(-1), t.type).reshape(t.n_rows, -1).T
        got = load_matrix(t.type, raw, t.shape[0]).matmul(x, precise=True)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-3), name


def test_supported_types_cover_the_issue_list():
    assert set(TYPES) | set(RANDOM_BLOCK_SCALES) <= SUPPORTED_TYPES


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("row_counts", [[576, 192, 192], [576], [1536, 1536], [2048, 512, 512], [49152], [32, 32],
                                        [768] * 3, [8192, 8192]], ids=str)
def test_decode_tasks_share_rows_evenly_between_threads(monkeypatch, row_counts, threads):
    """The decode products' task size: whole groups of interleaved rows, at most TASK_ROWS, and no
    size they allow would leave the busiest thread fewer rows (the parallel loop gives each
    thread an equal count of tasks, one after the other: SmolLM2's 576-row matrices in tasks
    of 64 rows left one thread 5 tasks and the other 4)."""
    from kernels_cpu import matmul
    monkeypatch.setattr(matmul, "memory_streams", lambda: 1)
    monkeypatch.setattr(matmul.numba, "get_num_threads", lambda: threads)
    rows = matmul.task_rows(row_counts)
    assert rows % matmul.MIN_TASK_ROWS == 0 and matmul.MIN_TASK_ROWS <= rows <= matmul.TASK_ROWS

    def busiest(size):  # the most rows one thread's share of consecutive tasks holds
        tasks = [min(size, n - first) for n in row_counts for first in range(0, n, size)]
        share = -(-len(tasks) // threads)
        return max(sum(tasks[i:i + share]) for i in range(0, len(tasks), share))
    assert all(busiest(rows) <= busiest(size) for size in range(matmul.MIN_TASK_ROWS, rows, matmul.MIN_TASK_ROWS))
    if threads == 2 and row_counts in ([576, 192, 192], [576]):
        assert busiest(rows) * 2 == sum(row_counts)
