"""Our quantizers against llama.cpp's reference quantizers (libgguf): identical bytes."""
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.quants import BLOCK_QUANTIZERS, quantize
from gguf_io.quant_types import FLOAT_TYPES

libgguf = pytest.importorskip("libgguf")

# the types ggrun quantizes to (F32 is stored as it is)
TYPES = sorted(FLOAT_TYPES - {T.F32}) + list(BLOCK_QUANTIZERS)


def _inputs(rng, kind, n=48, k=768):
    if kind == "normal":
        return rng.standard_normal((n, k)) * rng.uniform(1e-3, 3, (n, 1))
    if kind == "heavy":  # outliers, as real weights have
        return rng.standard_t(2, (n, k)) * 0.02
    if kind == "positive":
        return rng.uniform(0, 1, (n, k))
    if kind == "sparse":
        return rng.standard_normal((n, k)) * (rng.uniform(0, 1, (n, k)) < 0.1)
    x = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-8, 4, (n, 1))  # "scales": tiny to large
    x[0] = 0.0
    x[1] = 0.5
    x[2, ::2] = -1e-20
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "heavy", "positive", "sparse", "scales"])
def test_bytes_identical_to_llama_cpp(qtype, kind):
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}/{kind}".encode()))  # the same inputs in every process
    x = _inputs(rng, kind).astype(np.float32)
    ours = quantize(x, qtype)
    ref = np.ascontiguousarray(libgguf.quantize_rows(x, int(qtype))).view(np.uint8).reshape(ours.shape)
    assert np.array_equal(ours, ref)
    back = dequantize(ours.reshape(-1), qtype).reshape(x.shape)
    assert np.isfinite(back).all()


def _importance(rng, kind, k):
    """An importance matrix's column means: spread over decades, as real ones are; some columns 0 (never
    activated) in "sparse"."""
    qw = 10.0 ** rng.uniform(-4, 2, k)
    if kind == "sparse":
        qw[rng.uniform(0, 1, k) < 0.2] = 0
    return qw.astype(np.float32)


def _ggml_quantize_chunk(ggml_base, x, qtype, imatrix):
    """llama.cpp b11434's ggml_quantize_chunk (llama-quantize's call) on the rows of x, given quant_weights
    (or None)."""
    import ctypes
    f = ggml_base.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
    x = np.ascontiguousarray(x, dtype=np.float32)
    imatrix = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    out = np.zeros((x.shape[0], int(libgguf.row_size(int(qtype), x.shape[1]))), np.uint8)
    f(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None if imatrix is None else imatrix.ctypes.data)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bytes_identical_to_llama_cpp_with_an_importance_matrix(qtype, ggml_base):
    """llama.cpp's quantizers given quant_weights: the _impl searches where the type has one, the
    reference where it ignores them (Q8_0, MXFP4, the float types). Against b11434's own
    ggml_quantize_chunk: libgguf's (0.2.2) make_qkx3_quants is an older one, which rounds a weight
    scaled to +inf to 0 rather than nmax, and so differs on Q2_K's sparse rows here."""
    for kind in ("normal", "heavy", "positive", "sparse", "scales"):
        rng = np.random.default_rng(zlib.crc32(f"{qtype.name}/{kind}/imatrix".encode()))
        x = _inputs(rng, kind, n=16).astype(np.float32)
        qw = _importance(rng, kind, x.shape[1])
        assert np.array_equal(quantize(x, qtype, qw), _ggml_quantize_chunk(ggml_base, x, qtype, qw)), kind


def test_each_group_of_rows_has_its_own_importance():
    """(G, K) importance: row r weighed by group r // (N / G), as llama-quantize gives each expert its slice."""
    rng = np.random.default_rng(1)
    x = _inputs(rng, "heavy", n=12, k=256).astype(np.float32)
    qw = np.stack([_importance(rng, "normal", 256) for _ in range(3)])
    grouped = quantize(x, T.Q4_K, qw)
    for g in range(3):
        assert np.array_equal(grouped[4 * g:4 * g + 4], quantize(x[4 * g:4 * g + 4], T.Q4_K, qw[g]))
    with pytest.raises(ValueError, match="does not fit"):
        quantize(x, T.Q4_K, np.ones((5, 256), np.float32))  # (12 rows are not 5 equal groups)


def test_real_weights_bytes_identical(smollm, ggml_base):
    """Dequantized real SmolLM2 rows requantized to every type, without and with an importance matrix."""
    from gguf.quants import dequantize as deq
    f = smollm.file
    rows = deq(f.tensor_bytes("blk.3.ffn_down.weight")[:64].reshape(-1), f.tensors["blk.3.ffn_down.weight"].type)
    x = rows.reshape(64, -1)[:, :1536].astype(np.float32)
    qw = _importance(np.random.default_rng(0), "normal", x.shape[1])
    for qtype in TYPES:
        ours = quantize(x, qtype)
        ref = np.ascontiguousarray(libgguf.quantize_rows(x, int(qtype))).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, ref), qtype.name
        assert np.array_equal(quantize(x, qtype, qw), _ggml_quantize_chunk(ggml_base, x, qtype, qw)), \
            f"{qtype.name} with an importance matrix"


def test_refuses_bad_row_length():
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 100), np.float32), T.Q4_K)
