"""Decode's default products, on 8-bit activations as llama.cpp rounds them (its vec_dot_types):
the rounding against llama.cpp's own reference quantizers, and the products against exact
arithmetic, on every instruction path this CPU can run.

The error bound. The weights' integers times the activations' are summed exactly in integers, so
a product differs from the exact one by the rounding of the activations plus float32 sums:
- Q8_0 (32-weight types): |x - d16 * q| <= d / 2 + |d - d16| * 127 <= d * (1/2 + 127 * 2^-11),
  under 0.5625 d, where d = max|x| / 127 of the block and d16 is d rounded to float16;
- Q8_K (K-quants): d is float32, so |x - d * q| <= |d| / 2 up to float32 rounding (0.5625 |d| too).
Summed over a row: |got - exact| <= 0.5625 * sum_i |w_i| * |d_block(i)| + the float32 sums'
1e-5 * max|w| * sum|x|, the precise path's bound (test_kernels.py).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gguf_io.quant_types import QUANT_TYPES
from kernels_cpu.activations import quantize_q8_0, quantize_q8_k
from kernels_cpu.cpu_features import int8_isa, target_features
from kernels_cpu.decoded_tiles import GROUP_TYPES, TILE_TYPES, decodes_in_tiles
from kernels_cpu.interleaved import LAYOUTS as INTERLEAVED
from kernels_cpu.interleaved import interleaves
from kernels_cpu import amx_int8
from kernels_cpu.matmul import (PREFILL_TASK_ROWS, _formats, _ManyTokens, load_matrix, many_products,
                                many_products_amx)
from kernels_cpu.rowdot_float import FLOAT_BYTES

from .test_kernels import RANDOM_BLOCK_SCALES, _random_blocks, _weights

libgguf = pytest.importorskip("libgguf")

LEGACY = [t for t, q in QUANT_TYPES.items() if q.activations == "q8_0"]
K_QUANTS = [t for t, q in QUANT_TYPES.items() if q.activations == "q8_k"]
ROUNDING = 0.5625  # of a block's scale, the most an activation moves (module doc)
LAYOUTS = ["rows", "interleaved"]


def _activations(rng, tokens, k, kind):
    """Activations with what a rounding must handle: ties (halves of the scale), zero blocks, a
    lone outlier, negative maxima and magnitudes from 1e-6 to 1e4."""
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    if kind == "hard":
        x *= 10.0 ** rng.integers(-6, 4, (tokens, k // 32)).repeat(32, axis=1)
        x[:, :32] = np.arange(32) * 0.5 - 8  # ties at 127 * (v / max) for whole halves
        if k >= 128:
            x[:, 32:64] = 0.0
            x[:, 64:96] *= 1e-3
            x[:, 70] = -50.0
    return x.astype(np.float32)


def _q8_k_reference(ggml_base, x):
    """llama.cpp's quantize_row_q8_K_ref on each row of x: (d, q, bsums)."""
    block = np.dtype([("d", np.float32), ("qs", np.int8, 256), ("bsums", np.int16, 16)])
    fn = ggml_base.quantize_row_q8_K_ref
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    rows = []
    for row in np.ascontiguousarray(x, dtype=np.float32):
        out = np.zeros(len(row) // 256, dtype=block)
        fn(row.ctypes.data, out.ctypes.data, len(row))
        rows.append(out)
    out = np.stack(rows)
    return out["d"], out["qs"].reshape(len(x), -1), out["bsums"].reshape(len(x), -1)


def _q8_0_reference(x):
    """llama.cpp's quantize_row_q8_0_ref (libgguf) on each row of x: (d as float32, q)."""
    blocks = libgguf.quantize_rows(np.ascontiguousarray(x), int(T.Q8_0)).reshape(len(x), -1, 34)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
    return d, np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(len(x), -1)


@pytest.mark.parametrize("kind", ["normal", "hard"])
def test_q8_0_activations_match_llama_cpp(kind):
    x = _activations(np.random.default_rng(1), 7, 1024, kind)
    q, d, sums, scaled_sums = quantize_q8_0(x)
    want_d, want_q = _q8_0_reference(x)
    assert np.array_equal(q, want_q) and np.array_equal(d, want_d)
    assert np.array_equal(sums, q.reshape(7, -1, 32).sum(axis=2, dtype=np.int64))
    assert np.array_equal(scaled_sums, d * sums.astype(np.float32))


@pytest.mark.parametrize("kind", ["normal", "hard"])
def test_q8_k_activations_match_llama_cpp(kind, ggml_base):
    x = _activations(np.random.default_rng(2), 7, 1024, kind)
    x[3, 256:512] = 0.0  # a zero super-block
    x[4, 300] = -abs(x[4]).max() * 2  # a negative extreme, which maps to +127
    for row, (first, second) in ((5, (-1, 1)), (6, (1, -1))):  # the largest magnitude with both signs
        x[row, 512:768] = np.clip(x[row, 512:768], -2.0, 2.0)
        x[row, 530], x[row, 700] = 3.0 * first, 3.0 * second
    q, d, sums = quantize_q8_k(x)
    want_d, want_q, want_sums = _q8_k_reference(ggml_base, x)
    assert np.array_equal(q, want_q) and np.array_equal(d, want_d) and np.array_equal(sums, want_sums)


def _rounded(x, qtype):
    """x as the kernel's activations for qtype (from llama.cpp's quantizers) and each value's scale."""
    if GGML_QUANT_SIZES[qtype][0] == 256:
        q, d, _ = quantize_q8_k(x)  # (equal to quantize_row_q8_K_ref: test above)
        scales = np.repeat(d, 256, axis=1)
    else:
        d, q = _q8_0_reference(x)
        scales = np.repeat(d, 32, axis=1)
    return q.astype(np.float64) * scales, np.abs(scales).astype(np.float64)


def _check_products(m, ref, x):
    got = m.matmul(x)
    rounded, scales = _rounded(x, m.qtype)
    float_error = 1e-5 * np.abs(ref).max() * np.abs(x).sum(axis=1, keepdims=True) + 1e-30
    assert np.all(np.abs(got - rounded @ ref.T) <= float_error), "not the exact product of the rounded activations"
    bound = ROUNDING * scales @ np.abs(ref).T + float_error
    assert np.all(np.abs(got - x.astype(np.float64) @ ref.T) <= bound)


def _token_counts(layout):
    """(tokens, activations' kind) to test: decode's few tokens, and prefill's many where they
    take 8-bit products too (interleaved groups, or rows decoded in tiles), in a count that is
    not a multiple of the tokens per pass."""
    many = [(41, "hard")] if layout == "interleaved" else []
    return [(1, "normal"), (5, "hard")] + many


def _matrix(qtype, raw, k, layout):
    """The matrix in a layout: the file's rows, or the 8-bit path's: interleaved groups
    (interleaved.py), or for the types without them, rows whose prefill decodes them in tiles
    (decoded_tiles.py)."""
    if layout == "interleaved" and not (interleaves(qtype, raw.shape[0]) or decodes_in_tiles(qtype, raw.shape[0])):
        pytest.skip(f"{qtype.name} rows of this count are not interleaved")
    m = load_matrix(qtype, raw, k, interleaved=layout == "interleaved")
    assert (m.groups is not None) == (layout == "interleaved" and qtype in INTERLEAVED)
    assert m.decoded_tiles == (layout == "interleaved" and qtype not in INTERLEAVED)
    return m


def _quantized(w, qtype):
    """w's rows as blocks of qtype, quantized by gguf.quants where it can, else by llama.cpp
    (libgguf)."""
    if qtype in (T.IQ4_NL,):  # (gguf.quants only decodes it)
        return np.ascontiguousarray(libgguf.quantize_rows(w, int(qtype))).view(np.uint8).reshape(len(w), -1)
    return quantize(w, qtype).view(np.uint8).reshape(len(w), -1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "extreme", "positive"])
@pytest.mark.parametrize("n,k", [(1, 32), (37, 256), (40, 512), (130, 576)])
def test_legacy_products_are_exact_on_rounded_activations(qtype, kind, n, k, layout):
    rng = np.random.default_rng(n * k + len(kind))
    raw = _quantized(_weights(rng, n, k, kind), qtype)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    for tokens, x_kind in _token_counts(layout):
        _check_products(_matrix(qtype, raw, k, layout), ref, _activations(rng, tokens, k, x_kind))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "zero", "extreme"])
@pytest.mark.parametrize("n,k", [(1, 256), (29, 768), (32, 512)])
def test_k_quant_products_are_exact_on_rounded_activations(qtype, case, n, k, layout):
    rng = np.random.default_rng(k + n)
    raw = _random_blocks(rng, qtype, n, k, case)
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k).astype(np.float64)
    for tokens, x_kind in _token_counts(layout):
        _check_products(_matrix(qtype, raw, k, layout), ref, _activations(rng, tokens, k, x_kind))


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED), ids=lambda t: t.name)
def test_interleaved_rows_read_back_as_the_file_holds_them(qtype):
    """Embeddings and prefill read rows out of the groups: bytes and floats as the file's rows."""
    rng = np.random.default_rng(int(qtype))
    n, k = 48, 512
    raw = (_random_blocks(rng, qtype, n, k, "random") if qtype in RANDOM_BLOCK_SCALES else
           _quantized(_weights(rng, n, k, "normal"), qtype))
    m = load_matrix(qtype, raw, k, interleaved=True)
    assert np.array_equal(m.row_blocks(0, n), raw) and np.array_equal(m.row_blocks(13, 30), raw[13:30])
    ids = np.array([0, 7, 8, 47, 23, 23])
    ref = dequantize(raw.reshape(-1), qtype).reshape(n, k)
    assert np.array_equal(m.rows(ids), ref[ids])


def _random_rows(rng, qtype, n, k):
    """n random rows of k weights as a file of qtype holds them."""
    if qtype in RANDOM_BLOCK_SCALES:
        return _random_blocks(rng, qtype, n, k, "random")
    w = _weights(rng, n, k, "normal")
    if qtype == T.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    return _quantized(w, qtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", [*FLOAT_BYTES, *LEGACY, *K_QUANTS], ids=lambda t: t.name)
def test_products_alone_or_together_are_the_same_bits(qtype, layout):
    """A few tokens' products go several tokens per pass over the weights (a verified draft), a
    single token's one at a time: a token's results must not depend on which tokens come with it,
    to the last bit, or greedy speculative decoding could part from plain decoding at a near tie."""
    if layout == "interleaved" and qtype in FLOAT_BYTES:
        pytest.skip("float rows are not interleaved")
    rng = np.random.default_rng(int(qtype))
    # float rows go in pairs for several tokens: an odd count leaves one out of them; quantized
    # ones interleave in groups, which need a multiple of their size
    n, k = (47 if qtype in FLOAT_BYTES else 48), 768
    m = _matrix(qtype, _random_rows(rng, qtype, n, k), k, layout)
    x = _activations(rng, 8, k, "hard")
    alone = np.concatenate([m.matmul(x[t:t + 1]) for t in range(8)])
    for tokens in range(2, 9):  # (whole passes, and what is left in passes of fewer: 7 = 4 + 2 + 1)
        assert np.array_equal(m.matmul(x[:tokens]), alone[:tokens]), f"{tokens} tokens together"


@pytest.mark.parametrize("qtype", sorted(TILE_TYPES | GROUP_TYPES), ids=lambda t: t.name)
def test_prefill_bands_alone_or_together_are_the_same_bits(qtype):
    """Prefill's bands (decoded_tiles.py) hold 16 tokens, one a lane: a token's products must not
    depend on its band or lane (41 tokens, then their last 36 in other lanes), and for the types
    decoded from interleaved groups they are a one-token pass's bits (a verified draft of more
    than a few tokens goes through prefill's products)."""
    rng = np.random.default_rng(int(qtype))
    n, k = 48, 768
    m = load_matrix(qtype, _random_rows(rng, qtype, n, k), k, interleaved=True)
    x = _activations(rng, 41, k, "hard")
    together = m.matmul(x)
    assert np.array_equal(m.matmul(x[5:]), together[5:])
    if qtype in GROUP_TYPES:
        alone = np.concatenate([m.matmul(x[t:t + 1]) for t in range(len(x))])
        assert np.array_equal(together, alone)


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED), ids=lambda t: t.name)
def test_amx_tiles_give_the_vector_paths_bits(qtype):
    """Prefill's products on AMX's integer tiles (amx_int8.py) sum the same integers and scale
    them in the same order as the vector path: the same bits, rows and tokens past whole tiles
    included (tasks of 64, 64 and 8 rows; 41 tokens, two tiles and 9)."""
    if not amx_int8.usable():
        pytest.skip("this CPU has no AMX integer tiles")
    rng = np.random.default_rng(int(qtype))
    n, k, tokens = 136, 512, 41
    m = load_matrix(qtype, _random_rows(rng, qtype, n, k), k, interleaved=True)
    acts = _ManyTokens(_activations(rng, tokens, k, "hard"), k).int8(m.descriptor, _formats([m]))
    vector, tiles = np.full((tokens, n), np.nan, np.float32), np.full((tokens, n), np.nan, np.float32)
    many_products(m.descriptor, m.prefill_tasks, acts, vector)
    works = np.empty((numba.config.NUMBA_NUM_THREADS, amx_int8.work_bytes(PREFILL_TASK_ROWS, k)), np.uint8)
    many_products_amx(m.descriptor, m.prefill_tasks, acts, tiles, works)
    assert np.array_equal(vector, tiles)


# Each instruction path, by the target Numba compiles for (cpu_features.target_features). The
# generic one is a CPU before AVX2 (Ivy Bridge); the kernels need F16C for float16, whose
# conversions would otherwise be library calls that Numba's JIT does not link.
PATHS = {"avx2": ("haswell", "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+lzcnt,+movbe"),
         "generic": ("ivybridge", "+avx,+f16c,+popcnt,+sse4.2")}


def _runnable(path: str) -> bool:
    return {f[1:] for f in PATHS[path][1].split(",") if f} <= set(target_features())


@pytest.fixture(scope="module", autouse=True)
def path_runs(request):
    """The product tests, each path this CPU runs but the native one in a fresh process of its
    own, all started with this module's first test when the session runs the path test: each
    compiles every kernel alone, on one core, for its target, while this process runs the rest."""
    runs = {}
    wanted = any(item.originalname == "test_every_instruction_path_this_cpu_runs" for item in request.session.items)
    for path, (cpu, features) in PATHS.items():
        if wanted and _runnable(path):
            env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}
            code = "from kernels_cpu.cpu_features import int8_isa; print(int8_isa())"
            tests = "(exact_on_rounded and (normal or random) and not 130) or alone_or_together"
            runs[path] = (subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True),
                          subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                            "-o", "addopts=", __file__, "-k", tests], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    yield runs
    for check, run in runs.values():
        for process in (check, run):  # (a test that failed before reading them leaves them running)
            process.kill()
            process.wait()
            process.stdout.close()


@pytest.mark.parametrize("path", ["native", *PATHS])
def test_every_instruction_path_this_cpu_runs(path, path_runs):
    """The product tests above, compiled for each path this CPU can execute: here (the native
    one) and, in a fresh process, the AVX2-only and the generic targets."""
    if path == "native":
        assert int8_isa() in ("vnni", "avx2", "generic")
        return
    if not _runnable(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    check, run = path_runs[path]
    assert check.communicate()[0].strip() == path
    output = run.communicate()[0]
    assert run.returncode == 0, output[-5000:]
