"""The IQ1 quantizers (convert/quants_iq1.py) against llama.cpp's: identical bytes.

The reference is llama.cpp b11434's own ggml_quantize_chunk (libggml-base, the ggml_base
fixture), not libgguf: libgguf's IQ1_S gives the same bytes, but its IQ1_M is an older
llama.cpp's (before the search's prefix sums were kept per half-block), whose float32 sums round
differently and pick other grid entries. (Each library builds its IQ1 neighbour tables on first
use, for seconds, so one reference keeps this file quick.)"""
import zlib
from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.quants_iq1 import IQ1_TYPES, quantize_iq1, tables
from tests.test_quants import _ggml_quantize_chunk, _inputs
from tests.test_quants_iq2 import KINDS, _importance


@pytest.fixture(scope="module")
def reference(ggml_base):
    """llama.cpp's ggml_quantize_chunk: (x, qtype, importance or None) -> (rows, bytes) uint8."""
    return partial(_ggml_quantize_chunk, ggml_base)


@pytest.mark.parametrize("qtype", IQ1_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_identical_to_llama_cpp(qtype, kind, reference):
    rng = np.random.default_rng(zlib.crc32(f"iq1/{qtype.name}/{kind}".encode()))
    x = _inputs(rng, kind, n=12, k=512).astype(np.float32)
    importance = _importance(rng, x.shape[1])
    ours = quantize_iq1(x, qtype, importance)
    assert np.array_equal(ours, reference(x, qtype, importance))
    assert np.isfinite(dequantize(ours.reshape(-1), qtype)).all()


@pytest.mark.parametrize("qtype", IQ1_TYPES, ids=lambda t: t.name)
def test_degenerate_importance(qtype, reference):
    """All-zero, vanishing and widely ranging column weights (the searches find no fit, or
    products leave float32's normal range)."""
    rng = np.random.default_rng(zlib.crc32(f"iq1/degenerate/{qtype.name}".encode()))
    x = (rng.standard_normal((4, 256)) * 0.1).astype(np.float32)
    for importance in (np.zeros(256), np.full(256, 1e-30), 10.0 ** rng.uniform(-12, 12, 256)):
        importance = importance.astype(np.float32)
        ours = quantize_iq1(x, qtype, importance)
        assert np.array_equal(ours, reference(x, qtype, importance))


@pytest.mark.parametrize("kind", KINDS)
def test_iq1_m_without_importance(kind, reference):
    """IQ1_M alone quantizes without an importance matrix (weighting by x^2), as ggml does."""
    rng = np.random.default_rng(zlib.crc32(f"iq1/none/{kind}".encode()))
    x = _inputs(rng, kind, n=12, k=512).astype(np.float32)
    assert np.array_equal(quantize_iq1(x, T.IQ1_M, None), reference(x, T.IQ1_M, None))


def test_refuses_missing_importance():
    """llama.cpp asserts on a missing importance matrix for IQ1_S; we refuse."""
    with pytest.raises(ValueError, match="ggrun imatrix"):
        quantize_iq1(np.ones((1, 256), np.float32), T.IQ1_S, None)


def test_refuses_bad_shapes():
    with pytest.raises(ValueError):
        quantize_iq1(np.zeros((2, 100), np.float32), T.IQ1_M, None)
    with pytest.raises(ValueError):
        quantize_iq1(np.zeros((2, 256), np.float32), T.IQ1_S, np.ones(512, np.float32))
    with pytest.raises(ValueError):
        quantize_iq1(np.zeros((2, 256), np.float32), T.IQ2_S, None)
    with pytest.raises(ValueError):
        quantize_iq1(np.full((1, 256), np.nan, np.float32), T.IQ1_M, None)


def test_neighbour_tables():
    """IQ1_M uses IQ1_S's tables; every reachable off-grid point has entries at up to three
    distances, sorted by distance."""
    assert tables(T.IQ1_M) is tables(T.IQ1_S)
    levels, kmap, lists = tables(T.IQ1_S)
    assert levels.shape == (2048, 8) and len(set(kmap[kmap >= 0])) == 2048
    for u in (1, 0x5555, 0xAAAA, 0x1234 & 0xAAAA | 0x1, 0x2A):
        if kmap[u] >= 0:
            continue
        start = -1 - kmap[u]
        entries = lists[start + 1:start + 1 + lists[start]].astype(int)
        point = (u >> (2 * np.arange(8))) & 3
        d2 = ((levels[entries] - point) ** 2).sum(1)
        assert len(entries) and (np.diff(d2) >= 0).all() and len(set(d2)) <= 3


def test_real_weights_bytes_identical(smollm_path, reference):
    """Dequantized real SmolLM2 rows, with the column weights of their own squares."""
    from gguf_io import GGUFFile
    f = GGUFFile(smollm_path)
    name = "blk.3.ffn_down.weight"
    rows = dequantize(np.asarray(f.tensor_bytes(name)[:16]).reshape(-1), f.tensors[name].type)
    x = rows.reshape(16, -1).astype(np.float32)
    importance = np.sum(x * x, axis=0, dtype=np.float32)
    for qtype in IQ1_TYPES:
        ours = quantize_iq1(x, qtype, importance)
        assert np.array_equal(ours, reference(x, qtype, importance)), qtype.name
    assert np.array_equal(quantize_iq1(x, T.IQ1_M, None), reference(x, T.IQ1_M, None))
