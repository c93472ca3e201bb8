"""Norm, rotary embedding, attention, activation and helper kernels against plain numpy references."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from numba import njit

from kernels_cpu.backend import CpuBackend
from kernels_cpu.intrinsics import cache_product, exp_f32, rows_tag

be = CpuBackend()
rng = np.random.default_rng(1)


def test_rms_norm():
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(be.rms_norm(x, w, 1e-5), want, atol=1e-5)


def _rope_reference(x, positions, n_rot, base, neox, factors=None):
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    freqs = base ** (-np.arange(half) * 2.0 / n_rot)
    if factors is not None:
        freqs = freqs / factors
    for t, p in enumerate(positions):
        ang = p * freqs
        c, s = np.cos(ang), np.sin(ang)
        a = np.arange(half) if neox else np.arange(half) * 2
        b = a + half if neox else a + 1
        x0, x1 = out[t, :, a].copy(), out[t, :, b].copy()
        out[t, :, a] = x0 * c[:, None] - x1 * s[:, None]
        out[t, :, b] = x0 * s[:, None] + x1 * c[:, None]
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(neox, n_rot):
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    positions = np.array([0, 1, 7, 4000], dtype=np.int32)
    factors = rng.uniform(1, 8, n_rot // 2).astype(np.float32)
    for f in (None, factors):
        y = x.copy()
        be.rope(y, positions, n_rot, 10000.0, 1.0, neox, f)
        assert np.allclose(y, _rope_reference(x, positions, n_rot, 10000.0, neox, f), atol=2e-4)


def attention_case(n_tok, kv_type, d=37):
    """Queries, keys (kv heads, dim, slots), values (kv heads, slots, dim) and positions of a
    grouped-query attention over slots out of position order, one of them empty (the keys and
    values as plain arrays: filled_cache puts them into a backend's cache)."""
    n_head, n_kv, n_slots = 6, 2, n_tok + 301  # odd sizes: vector tails, part of a key tile; two slot chunks
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    keys = rng.standard_normal((n_kv, d, n_slots)).astype(kv_type)
    values = rng.standard_normal((n_kv, n_slots, d)).astype(kv_type)
    k_pos = np.arange(n_slots, dtype=np.int32) - 1
    k_pos[[0, 3]] = k_pos[[3, 0]]  # slot order is not position order
    k_pos[5] = -1                  # an empty slot
    q_pos = np.arange(n_slots - n_tok, n_slots, dtype=np.int32) - 1
    return q, keys, values, q_pos, k_pos


def filled_cache(backend, keys, values, to_backend=lambda a: a, kv_type=None):
    """A backend's cache (of kv_type, else the arrays' precision) holding keys (kv heads, dim,
    slots) and values (kv heads, slots, dim), through its store_kv."""
    n_kv, d, n = keys.shape
    kv_type = kv_type or {np.float16: "f16", np.float32: "f32"}[keys.dtype.type]
    cache_k, cache_v = backend.new_kv(n_kv, d, values.shape[2], n, kv_type)
    k, v = (to_backend(a.astype(np.float32)) for a in (keys.transpose(2, 0, 1), values.transpose(1, 0, 2)))
    backend.store_kv(cache_k, cache_v, np.arange(n, dtype=np.int64), k, v)
    return cache_k, cache_v


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("n_tok", [4, 20])  # the decode kernel and the BLAS path
@pytest.mark.parametrize("kv_type", [np.float16, np.float32])
def test_attention_grouped_causal(window, softcap, n_tok, kv_type):
    q, keys, v, q_pos, k_pos = attention_case(n_tok, kv_type)
    got = be.attention(q, *filled_cache(be, keys, v), q_pos, k_pos, 0.25, window, softcap)
    _assert_attention(got, q, keys.transpose(0, 2, 1), v, q_pos, k_pos, window, softcap)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("n_tok", [1, 4, 20])
@pytest.mark.parametrize("d", [32, 64])
def test_attention_over_a_q8_0_cache(window, n_tok, d):
    """The decode kernel and the BLAS path read the q8_0 blocks in place: the same attention as
    over the keys and values those blocks hold (read_kv)."""
    q, keys, v, q_pos, k_pos = attention_case(n_tok, np.float32, d)
    cache = filled_cache(be, keys, v, kv_type="q8_0")
    got = be.attention(q, *cache, q_pos, k_pos, 0.25, window, 2.0)
    held_k, held_v = be.read_kv(*cache, len(k_pos))
    assert 0 < np.abs(held_k - keys.transpose(2, 0, 1)).max() < 0.05  # (rounded, but not by much)
    _assert_attention(got, q, held_k.transpose(1, 0, 2), held_v.transpose(1, 0, 2), q_pos, k_pos, window, 2.0)


@pytest.mark.parametrize("n_tok", [1, 4, 20])  # the decode kernel (one and several queries) and the BLAS path
def test_attention_sinks_take_their_share(n_tok):
    """gpt-oss's sinks: a logit per head in the softmax's denominator, with no value; sinks far
    above the scores take nearly all the weight, and sinks at MASKED none (the same bits as
    attention without sinks)."""
    from kernels_cpu.attention import MASKED
    q, keys, v, q_pos, k_pos = attention_case(n_tok, np.float32)
    cache = filled_cache(be, keys, v)
    sinks = np.array([-3.0, 0.0, 1.5, 4.0, -20.0, 2.0], dtype=np.float32)
    got = be.attention(q, *cache, q_pos, k_pos, 0.25, 3, 0.0, sinks)
    _assert_attention(got, q, keys.transpose(0, 2, 1), v, q_pos, k_pos, 3, 0.0, sinks)
    plain = be.attention(q, *cache, q_pos, k_pos, 0.25, 0, 0.0)
    assert np.array_equal(be.attention(q, *cache, q_pos, k_pos, 0.25, 0, 0.0, np.full(6, MASKED)), plain)
    assert np.abs(be.attention(q, *cache, q_pos, k_pos, 0.25, 0, 0.0, np.full(6, 80.0, np.float32))).max() < 1e-20


def _assert_attention(got, q, k, v, q_pos, k_pos, window, softcap, sinks=None):
    """got against float64 attention with scale 0.25 over keys k and values v (kv heads, slots,
    dim), beside the heads' sink logits where given."""
    n_tok, n_head = q.shape[:2]
    n_kv = k.shape[0]
    k, v = k.astype(np.float64), v.astype(np.float64)
    for t in range(n_tok):
        for h in range(n_head):
            g = h // (n_head // n_kv)
            ok = (k_pos >= 0) & (k_pos <= q_pos[t])
            if window:
                ok &= q_pos[t] - k_pos < window
            s = (k[g] @ q[t, h]) * 0.25
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(ok, s, -np.inf)
            sink = -np.inf if sinks is None else float(sinks[h])
            top = max(s.max(), sink)
            p = np.exp(s - top)
            p /= p.sum() + np.exp(sink - top)
            assert np.allclose(got[t, h], p @ v[g], atol=1e-5)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("slots", [10, 40])  # a part of one key tile, several tiles
def test_store_kv_writes_the_slots(kv_type, slots):
    n_kv, d = 3, 20
    keys, values = be.new_kv(n_kv, d, d, slots, kv_type)
    k = rng.standard_normal((2, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((2, n_kv, d)).astype(np.float32)
    be.store_kv(keys, values, np.array([7, slots - 1]), k, v)
    got_k, got_v = be.read_kv(keys, values, slots)
    rounded = np.float16 if kv_type == "f16" else np.float32
    for got, want in ((got_k, k), (got_v, v)):
        assert np.array_equal(got[[7, slots - 1]], want.astype(rounded).astype(np.float32))
        assert not np.delete(got, [7, slots - 1], axis=0).any()


@pytest.mark.parametrize("slots", [10, 40])
def test_q8_0_cache_holds_llama_cpps_q8_0_blocks(slots):
    """What store_kv writes into a q8_0 cache reads back as llama.cpp's reference quantizer's
    blocks of the same rows (libgguf) hold, dequantized by gguf-py."""
    libgguf = pytest.importorskip("libgguf")
    n_kv, d = 3, 64
    keys, values = be.new_kv(n_kv, d, d, slots, "q8_0")
    k, v = ((rng.standard_normal((2, n_kv, d)) * 4).astype(np.float32) for _ in range(2))
    k[0, 1, :32] = 0.0                      # a block of zeros (scale 0)
    v[1, 0, :4] = [127.0, 2.5, -3.5, 0.5]  # scale 1 and halves: rounded away from zero, as C's roundf
    v[1, 0, 4:32] = 0.0
    be.store_kv(keys, values, np.array([7, slots - 1]), k, v)
    got_k, got_v = be.read_kv(keys, values, slots)
    for got, x in ((got_k, k), (got_v, v)):
        blocks = np.ascontiguousarray(libgguf.quantize_rows(x.reshape(-1, d), int(GGMLQuantizationType.Q8_0)))
        want = gguf_quants.dequantize(blocks.view(np.uint8), GGMLQuantizationType.Q8_0).reshape(x.shape)
        assert np.array_equal(got[[7, slots - 1]], want)
        assert not np.delete(got, [7, slots - 1], axis=0).any()


def test_q8_0_cache_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        be.new_kv(2, 48, 64, 16, "q8_0")


def test_silu_mul():
    g = rng.standard_normal((2, 10)).astype(np.float32)
    u = rng.standard_normal((2, 10)).astype(np.float32)
    want = g / (1 + np.exp(-g)) * u
    assert np.allclose(be.silu_mul(g.copy(), u), want, atol=1e-6)


def test_gelu_mul_is_the_tanh_approximation():
    g = (rng.standard_normal((3, 40)) * 4).astype(np.float32)
    u = rng.standard_normal((3, 40)).astype(np.float32)
    x = g.astype(np.float64)
    want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))) * u
    assert np.allclose(be.gelu_mul(g.copy(), u), want, rtol=1e-5, atol=1e-6)


@njit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def test_vectorized_exp_matches_numpy():
    x = np.concatenate([np.linspace(-87, 88, 100_001), [-1e30, -100.0, -87.5, 0.0, 1e-8, 88.0]]).astype(np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    normal = x >= -87
    assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) < 1e-6
    assert not got[~normal].any()  # exactly zero where float32 would turn subnormal, and for the mask value


@njit
def _cache_product(cache, kv, row_first, col_first, a, out, rows):
    cache_product(cache, kv, row_first, col_first, a, out, rows)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("rows,cols", [(37, 1), (37, 15), (64, 100), (5, 256), (300, 64)])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("queries", [1, 3, 4, 7])
def test_cache_product_against_numpy(dtype, rows, cols, tiled, queries):
    """The register-blocked product of attention: 64-, 16- and 1-column tails, both cache
    precisions, plain and tiled by 16 columns, for query counts below, at and past the four a
    pass takes."""
    cache = rng.standard_normal((3, 320, 352)).astype(dtype)
    a = rng.standard_normal((queries, rows)).astype(np.float32)
    out = np.zeros((queries, cols), np.float32)
    col_first = 16 if tiled else 11
    # (kv, rows, columns) -> (kv, columns / 16, rows, 16)
    arg = np.ascontiguousarray(cache.reshape(3, 320, 22, 16).transpose(0, 2, 1, 3)) if tiled else cache
    _cache_product(arg.view(np.uint16) if dtype == np.float16 else arg, 2, 7, col_first, a, out, rows_tag(len(a)))
    want = a.astype(np.float64) @ cache[2, 7:7 + rows, col_first:col_first + cols].astype(np.float64)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("n_tok", [1, 4, 20])  # the decode kernel (one and several queries) and the BLAS path
def test_attention_is_the_same_wherever_the_cache_keeps_its_keys(window, n_tok):
    """A sequence's keys in blocks scattered through a pool, out of order, among other blocks
    (runner/engine/kv_pool.py): the same bits as the same keys in one run of slots."""
    from kernels_cpu.attention import SLOT_CHUNK
    n_kv, d, n = 2, 64, 2 * SLOT_CHUNK + 90
    keys, values = (rng.standard_normal((n, n_kv, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n_tok, 6, d)).astype(np.float32)
    q_pos = np.arange(n - n_tok, n, dtype=np.int32)
    contiguous = be.new_kv(n_kv, d, d, n, "f16")
    be.store_kv(*contiguous, np.arange(n, dtype=np.int64), keys, values)
    want = be.attention(q, *contiguous, q_pos, np.arange(n, dtype=np.int32), 0.125, window, 0.0)
    blocks = np.array([4, 1, 2])  # (block 0 and 3: another sequence's)
    pool = be.new_kv(n_kv, d, d, 5 * SLOT_CHUNK, "f16")
    other = np.r_[np.arange(SLOT_CHUNK), np.arange(3 * SLOT_CHUNK, 4 * SLOT_CHUNK)]
    be.store_kv(*pool, other.astype(np.int64), *(rng.standard_normal((len(other), n_kv, d)).astype(np.float32)
                                                 for _ in range(2)))
    positions = np.arange(n)
    slots = blocks[positions // SLOT_CHUNK] * SLOT_CHUNK + positions % SLOT_CHUNK
    be.store_kv(*pool, slots, keys, values)
    k_pos = np.full(5 * SLOT_CHUNK, -1, dtype=np.int32)
    k_pos[slots] = positions
    assert np.array_equal(be.attention(q, *pool, q_pos, k_pos, 0.125, window, 0.0), want)


@pytest.mark.parametrize("window", [0, 40])
def test_lanes_attend_in_one_call_as_each_alone(window):
    """Several sequences' queries (lanes of 1, 3 and 2 tokens) over one pool, each lane over its
    own slots (scattered, of different spans, one past a chunk of SLOT_CHUNK slots): the same bits
    as each lane's attention alone."""
    from kernels_cpu.attention import SLOT_CHUNK
    n_kv, d, slots = 2, 64, 3 * SLOT_CHUNK + 120
    pool = be.new_kv(n_kv, d, d, slots, "f16")
    be.store_kv(*pool, np.arange(slots, dtype=np.int64),
                *(rng.standard_normal((slots, n_kv, d)).astype(np.float32) for _ in range(2)))
    lengths, tokens = (70, SLOT_CHUNK + 30, 5), (1, 3, 2)
    owner = rng.permutation(np.repeat(np.arange(3), [slots // 3] * 3))  # (each slot one lane's)
    key_positions, q_pos = [], []
    for lane, (n, t) in enumerate(zip(lengths, tokens)):
        held = np.flatnonzero(owner == lane)[:n]
        k_pos = np.full(held.max() + 1, -1, dtype=np.int32)
        k_pos[held] = rng.permutation(n)
        key_positions.append(k_pos)
        q_pos.append(np.arange(n - t, n, dtype=np.int32))
    starts = np.cumsum([0, *tokens]).tolist()
    q = rng.standard_normal((starts[-1], 6, d)).astype(np.float32)
    q_pos = np.concatenate(q_pos)
    got = be.attention_lanes(q, *pool, q_pos, key_positions, starts, 0.125, window, 0.0)
    alone = [be.attention(q[a:b], *pool, q_pos[a:b], k_pos, 0.125, window, 0.0)
             for a, b, k_pos in zip(starts, starts[1:], key_positions)]
    assert np.array_equal(got, np.concatenate(alone))
    with pytest.raises(ValueError, match="lanes"):
        be.attention_lanes(q, *pool, q_pos, key_positions, starts[:-1], 0.125, window, 0.0)


def ssm_case(tokens=5, heads=4, groups=2, head_dim=8, d_state=16, seed=2):
    """Operands of ssm_scan (x, dt, B, C, A, D) and a starting state."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    dt = np.log1p(np.exp(r.standard_normal((tokens, heads)))).astype(np.float32)
    b, c = (r.standard_normal((tokens, groups, d_state)).astype(np.float32) for _ in range(2))
    a, d = -r.uniform(0.5, 4, heads).astype(np.float32), r.standard_normal(heads).astype(np.float32)
    return (x, dt, b, c, a, d), r.standard_normal((heads, head_dim, d_state)).astype(np.float32)


def ssm_reference(x, dt, b, c, a, d, state):
    """Mamba2's scan in float64, head h reading group h // (heads / groups): (outputs, state after)."""
    s, per_group = state.astype(np.float64), x.shape[1] // b.shape[1]
    b, c = np.repeat(b, per_group, axis=1), np.repeat(c, per_group, axis=1)
    out = np.empty(x.shape)
    for t in range(x.shape[0]):
        s = s * np.exp(dt[t] * a)[:, None, None] + (x[t] * dt[t][:, None])[:, :, None] * b[t][:, None, :]
        out[t] = np.einsum("hij,hj->hi", s, c[t]) + x[t] * d[:, None]
    return out, s


def test_ssm_scan_against_numpy_token_by_token_too():
    operands, start = ssm_case()
    want, want_state = ssm_reference(*operands, start)
    state = start.copy()
    assert np.allclose(be.ssm_scan(*operands, state), want, atol=1e-4)
    assert np.allclose(state, want_state, atol=1e-4)
    state = start.copy()  # (one token a call, the state carried between)
    steps = [be.ssm_scan(*(v[t:t + 1] for v in operands[:4]), *operands[4:], state) for t in range(5)]
    assert np.allclose(np.concatenate(steps), want, atol=1e-4)


def test_ssm_scan_refuses_operands_that_do_not_fit():
    (x, dt, b, c, a, d), state = ssm_case()
    with pytest.raises(ValueError, match="do not fit"):
        be.ssm_scan(x, dt, b[:, :1, :8], c, a, d, state)
    with pytest.raises(ValueError, match="do not fit"):
        be.ssm_scan(x, dt, b, c, a, d, state[:, :4])


UNARY_REFERENCE = {"silu": lambda x: x / (1 + np.exp(-x)), "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
                   "softplus": lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))),
                   "relu_sqr": lambda x: np.maximum(x, 0) ** 2}


def test_unary_kinds_against_numpy():
    from kernels_cpu.ops import UNARY
    x = (rng.standard_normal((3, 40)) * 8).astype(np.float32)
    assert set(UNARY) == set(UNARY_REFERENCE)
    for kind, reference in UNARY_REFERENCE.items():
        assert np.allclose(be.unary(x, kind), reference(x.astype(np.float64)), rtol=1e-5, atol=1e-6), kind
