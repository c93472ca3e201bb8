"""kernels_gpu against gguf.quants and the Numba kernels, with [1/7]'s tolerances.

The tests run on torch's CPU device unless GGRUN_TEST_DEVICE names another (scripts/gpu_check
runs them on cuda, where the decode products are compiled and steps replay from CUDA graphs).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gguf_io import GGUFFile
from gguf_io.quant_types import BLOCK_TYPES, QUANT_TYPES
from kernels_cpu.backend import CpuBackend
from kernels_cpu.matmul import load_matrix

from .test_kernels import RANDOM_BLOCK_SCALES, _random_blocks, _weights
from .test_moe import _route_case, _route_reference
from .test_ops import attention_case, filled_cache

torch = pytest.importorskip("torch")
from kernels_gpu.backend import TorchBackend  # noqa: E402
from kernels_gpu.dequant import DEQUANTIZE  # noqa: E402
from kernels_gpu.matmul import Products, row_dots, upload  # noqa: E402
from kernels_gpu.step_graph import MIN_SLOTS, padded_length  # noqa: E402

DEVICE = os.environ.get("GGRUN_TEST_DEVICE", "cpu")
be = TorchBackend(DEVICE, precise=True)  # (the default multiplies prefill's tiles in TF32 on CUDA)
cpu = CpuBackend()
rng = np.random.default_rng(7)
ALL_TYPES = list(QUANT_TYPES)
try:  # (float rows: torch.compile; block types without a Triton decoder: dequant.py's decoders)
    from kernels_gpu.triton_blocks import DECODERS as TRITON_DECODERS
except ImportError:
    TRITON_DECODERS = {}
TRITON_TYPES = [t for t in ALL_TYPES if t in TRITON_DECODERS]


def _raw(qtype, n, k, kind="normal"):
    if qtype in RANDOM_BLOCK_SCALES:
        return _random_blocks(rng, qtype, n, k, "random")
    return quantize(_weights(rng, n, k, kind), qtype).view(np.uint8).reshape(n, -1)


def _np(x):
    return x.detach().cpu().numpy()


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def test_every_issue_type_is_supported():
    assert set(ALL_TYPES) <= be.supported_types


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    for n, k in [(1, 256), (29, 768)]:
        raw = _raw(qtype, n, k, "extreme")
        ref = dequantize(raw.reshape(-1), qtype).reshape(n, k)
        got = _np(DEQUANTIZE[qtype](_t(raw)))
        assert np.array_equal(got, ref), qtype.name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 256), (37, 512), (130, 768)])
def test_products_match_reference_and_numba(qtype, n, k):
    raw = _raw(qtype, n, k)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    # (the Numba matrix alone in its type set, as test_kernels' are: the backend's set grows with
    # each type it loads, a new compiled signature each time)
    w, numba_w = be.load_matrix(qtype, raw, k), load_matrix(qtype, raw, k)
    assert w.raw.dtype == torch.uint8 and w.raw.numel() == raw.size  # the file's bytes, not floats
    scale = np.abs(ref).max() + 1e-30
    for tokens in (1, 5, 20):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        got = _np(be.matmul(w, _t(x)))
        tol = 1e-5 * scale * np.abs(x).sum(axis=1, keepdims=True) + 1e-30
        assert np.all(np.abs(got - x.astype(np.float64) @ ref.T) <= tol), (qtype.name, tokens)
        assert np.all(np.abs(got - numba_w.matmul(x, precise=True)) <= 2 * tol), (qtype.name, tokens)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_default_prefill_products_within_tf32_rounding(qtype):
    """The default backend's products of several tokens: on CUDA in TF32, whose rounding of w and
    x to 10-bit mantissas (2^-11 each) bounds the error by 2^-10 of sum |w| |x| per output."""
    n, k = 37, 512
    raw = _raw(qtype, n, k)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((20, k)).astype(np.float32)
    got = _np(TorchBackend(DEVICE).matmul(be.load_matrix(qtype, raw, k), _t(x)))
    tol = 2.0 ** -10 * np.abs(x) @ np.abs(ref).T + 1e-5 * np.abs(ref).max() * np.abs(x).sum(axis=1, keepdims=True)
    assert np.all(np.abs(got - x @ ref.T) <= tol)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_row_dots_the_compiled_decode_function(qtype):
    """row_dots is what torch.compile fuses on CUDA; eagerly it must give the same products."""
    n, k = 19, 512
    raw = _raw(qtype, n, k)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal(k).astype(np.float32)
    got = _np(row_dots(DEQUANTIZE[qtype], _t(raw), _t(x)))
    tol = 1e-5 * np.abs(ref).max() * np.abs(x).sum()
    assert np.all(np.abs(got - ref @ x) <= tol)


def test_every_block_type_has_a_triton_decoder():
    pytest.importorskip("triton")
    assert set(TRITON_DECODERS) == BLOCK_TYPES


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
def test_triton_dequantizes_like_gguf(qtype):
    triton_products = pytest.importorskip("kernels_gpu.triton_products")
    assert set(triton_products.DECODERS) <= BLOCK_TYPES
    for n, k in [(1, 256), (29, 768)]:
        raw = _raw(qtype, n, k, "extreme")
        ref = dequantize(raw.reshape(-1), qtype).reshape(n, k)
        assert np.array_equal(_np(triton_products.dequantize(qtype, _t(raw), k)), ref), qtype.name


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
def test_triton_products_match_reference(qtype):
    """Decode's row dots (odd rows and blocks leave partial programs), prefill's tiles, and one
    token's expert products, which read only the chosen experts' rows."""
    pytest.importorskip("triton")
    products = Products(compiled=False, triton=True)
    n, k, experts = 19, 768, 3
    raw = _raw(qtype, n * experts, k)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n * experts, k).astype(np.float64)
    scale = np.abs(ref).max() + 1e-30
    for tokens in (1, 3):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        got = _np(products.matmul(upload(qtype, raw, k, DEVICE), _t(x)))
        tol = 1e-5 * scale * np.abs(x).sum(axis=1, keepdims=True)
        assert np.all(np.abs(got - x @ ref.T) <= tol), (qtype.name, tokens)
    ids = np.array([[2, 0]])
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = _np(products.expert_matmul(upload(qtype, raw, k, DEVICE, experts), _t(x), _t(ids)))
    want = np.stack([x[s] @ ref[e * n:(e + 1) * n].T for s, e in enumerate(ids[0])])
    tol = 1e-5 * scale * np.abs(x).sum(axis=1, keepdims=True)
    assert np.all(np.abs(got - want) <= tol), qtype.name


def test_row_dots_compile_into_one_graph_per_type():
    """torch.compile traces the row dots without a graph break (fullgraph), here with the CPU's
    inductor (on CUDA the same trace becomes a Triton kernel), and keeps types apart: Q4_0 and
    Q4_K rows of 512 weights are both 288 bytes."""
    products = Products(compiled=True)
    x = _t(rng.standard_normal((1, 512)).astype(np.float32))
    for qtype in (T.Q4_0, T.Q4_K):
        w = upload(qtype, _raw(qtype, 8, 512), 512, DEVICE)
        want = Products(compiled=False).matmul(w, x)
        assert torch.allclose(products.matmul(w, x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("model", ["smollm_path", "gemma_path"])
def test_real_tensors_decode_like_reference(model, request):
    f = GGUFFile(request.getfixturevalue(model))
    seen = set()
    for name, t in f.tensors.items():
        if len(t.shape) != 2 or t.type in seen:
            continue
        seen.add(t.type)
        raw = f.tensor_bytes(name)
        rows = np.arange(min(t.n_rows, 64))
        ref = dequantize(raw[rows].reshape(-1), t.type).reshape(len(rows), t.shape[0])
        w = be.load_matrix(t.type, raw, t.shape[0])
        assert np.array_equal(_np(w.rows(_t(rows))), ref), name


def test_rms_norm_and_activations_match_numba():
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    assert np.allclose(_np(be.rms_norm(_t(x), _t(w), 1e-5)), cpu.rms_norm(x, w, 1e-5), atol=1e-5)
    up = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.allclose(_np(be.silu_mul(_t(x), _t(up))), cpu.silu_mul(x.copy(), up), atol=1e-5)
    assert np.allclose(_np(be.gelu_mul(_t(x), _t(up))), cpu.gelu_mul(x.copy(), up), atol=1e-5)
    assert np.allclose(_np(be.softcap(_t(x), 1.5)), cpu.softcap(x, 1.5), atol=1e-6)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "softmax_weight"])
@pytest.mark.parametrize("norm", [False, True])
def test_route_with_a_selection_bias_matches_reference(gating, norm):
    """The bias chooses the experts (changing some choices), the weights are the unbiased
    probabilities (the tie of _route_case is broken by the bias: torch's top-k breaks ties as it may)."""
    logits, bias = _route_case(gating, biased=True)
    ids, weights = be.route(_t(logits), 4, gating, norm, 2.5, _t(bias))
    want_ids, want_weights = _route_reference(logits.astype(np.float64), 4, gating, norm, 2.5, bias)
    assert np.array_equal(_np(ids), want_ids)
    assert np.allclose(_np(weights), want_weights, rtol=1e-5)


def test_rope_matches_numba():
    x = rng.standard_normal((5, 2, 32)).astype(np.float32)
    positions = np.array([3, 0, 100, 9, 70000], dtype=np.int32)
    cases = [(neox, n_rot, factors) for neox in (False, True) for n_rot in (32, 16)
             for factors in (None, rng.uniform(1, 8, n_rot // 2).astype(np.float32))]
    for neox, n_rot, factors in cases:
        want, got = x.copy(), _t(x)
        cpu.rope(want, positions, n_rot, 500000.0, 2.0, neox, factors)
        be.rope(got, positions, n_rot, 500000.0, 2.0, neox, None if factors is None else _t(factors))
        assert np.allclose(_np(got), want, atol=1e-5), (neox, n_rot)


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
def test_store_kv_matches_numba(kv_type):
    n_kv, d, slots_n = 2, 64 if kv_type == "q8_0" else 8, 10
    k = rng.standard_normal((3, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((3, n_kv, d)).astype(np.float32)
    slots = np.array([4, 0, 9], dtype=np.int64)
    keys, values = be.new_kv(n_kv, d, d, slots_n, kv_type)
    want_k, want_v = cpu.new_kv(n_kv, d, d, slots_n, kv_type)
    be.store_kv(keys, values, slots, _t(k), _t(v))
    cpu.store_kv(want_k, want_v, slots, k, v)
    for got, want in zip(be.read_kv(keys, values, slots_n), cpu.read_kv(want_k, want_v, slots_n)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("n_tok", [1, 20])
@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
def test_attention_matches_numba(window, softcap, n_tok, kv_type):
    dtype = np.float16 if kv_type == "f16" else np.float32
    q, keys, values, q_pos, k_pos = attention_case(n_tok, dtype, 64 if kv_type == "q8_0" else 37)
    want = cpu.attention(q, *filled_cache(cpu, keys, values, kv_type=kv_type), q_pos, k_pos, 0.3, window, softcap)
    # slots past the ones attention is told to read (graph padding) must not count
    n_kv, d = keys.shape[:2]
    padded = np.concatenate([k_pos, np.full(5, -1, np.int32)])
    keys_p = np.concatenate([keys, np.full((n_kv, d, 5), 9.0, dtype)], axis=2)
    values_p = np.concatenate([values, np.full((n_kv, 5, d), 9.0, dtype)], axis=1)
    cache = filled_cache(be, keys_p, values_p, _t, kv_type=kv_type)
    got = be.attention(_t(q), *cache, _t(q_pos), _t(padded), 0.3, window, softcap)
    assert np.allclose(_np(got), want, atol=2e-5)
    sinks = np.linspace(-2.0, 3.0, q.shape[1], dtype=np.float32)  # (gpt-oss's attention sinks)
    want = cpu.attention(q, *filled_cache(cpu, keys, values, kv_type=kv_type), q_pos, k_pos, 0.3, window, softcap,
                         sinks)
    got = be.attention(_t(q), *cache, _t(q_pos), _t(padded), 0.3, window, softcap, _t(sinks))
    assert np.allclose(_np(got), want, atol=2e-5)


def test_lanes_attention_matches_numba():
    """Two sequences' queries (2 and 1 tokens) in one call, each over its own slots of one cache."""
    q, keys, values, q_pos, k_pos = attention_case(3, np.float32, 37)
    lanes = [np.where(np.arange(len(k_pos)) % 2 == j, k_pos, -1).astype(np.int32) for j in range(2)]
    want = cpu.attention_lanes(q, *filled_cache(cpu, keys, values), q_pos, lanes, [0, 2, 3], 0.3, 0, 0.0)
    got = be.attention_lanes(_t(q), *filled_cache(be, keys, values, _t), _t(q_pos), [_t(k) for k in lanes],
                             [0, 2, 3], 0.3, 0, 0.0)
    assert np.allclose(_np(got), want, atol=2e-5)


def test_padded_lengths_are_few_and_cover_the_cache():
    assert padded_length(1, 4096) == MIN_SLOTS
    assert padded_length(MIN_SLOTS + 1, 4096) == 2 * MIN_SLOTS
    assert padded_length(3000, 4096) == 4096
    assert padded_length(100, 64) == 64
    assert len({padded_length(n, 4096) for n in range(1, 4097)}) == 5


@pytest.mark.parametrize("tokens", [1, 3, 6, 70, 193])  # (token after token, then in chunks of 64, the last cut short)
def test_ssm_scan_matches_numba(tokens):
    from .test_ops import ssm_case, ssm_reference
    operands, start = ssm_case(tokens=tokens, heads=6, groups=3)
    exact, exact_state = ssm_reference(*operands, start)  # (float64)
    state, want_state = _t(start), start.copy()
    want = cpu.ssm_scan(*operands, want_state)
    got = _np(be.ssm_scan(*map(_t, operands), state))
    assert np.allclose(got, want, atol=1e-5)
    assert np.allclose(_np(state), want_state, atol=1e-5)
    assert np.abs(got - exact).max() < 1e-6 * np.abs(exact).max()
    assert np.abs(_np(state) - exact_state).max() < 1e-6 * np.abs(exact_state).max()


def test_unary_kinds_match_numba():
    from kernels_gpu.ops import UNARY
    x = (rng.standard_normal((3, 40)) * 8).astype(np.float32)
    for kind in UNARY:
        assert np.allclose(_np(be.unary(_t(x), kind)), cpu.unary(x, kind), rtol=1e-5, atol=1e-6), kind
