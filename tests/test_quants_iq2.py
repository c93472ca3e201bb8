"""The IQ2 quantizers (convert/quants_iq2.py) against llama.cpp's (libgguf): identical bytes."""
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.quants_iq2 import IQ2_TYPES, quantize_iq2, tables
from tests.test_quants import _inputs

libgguf = pytest.importorskip("libgguf")

KINDS = ["normal", "heavy", "positive", "sparse", "scales"]


def _reference(x, qtype, importance):
    return np.ascontiguousarray(libgguf.quantize_rows(x, int(qtype), imatrix=importance)).view(np.uint8)


def _importance(rng, k):
    """Random positive column weights, a fifth of them zero (columns no activation reached)."""
    w = rng.uniform(0.01, 10, k)
    w[rng.uniform(0, 1, k) < 0.2] = 0
    return w.astype(np.float32)


@pytest.mark.parametrize("qtype", IQ2_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_identical_to_llama_cpp(qtype, kind):
    rng = np.random.default_rng(zlib.crc32(f"iq2/{qtype.name}/{kind}".encode()))
    x = _inputs(rng, kind, n=12, k=512).astype(np.float32)
    importance = _importance(rng, x.shape[1])
    ours = quantize_iq2(x, qtype, importance)
    assert np.array_equal(ours, _reference(x, qtype, importance).reshape(ours.shape))
    assert np.isfinite(dequantize(ours.reshape(-1), qtype)).all()


@pytest.mark.parametrize("qtype", IQ2_TYPES, ids=lambda t: t.name)
def test_degenerate_importance(qtype):
    """All-zero, vanishing and widely ranging column weights (the searches find no fit, or
    products leave float32's normal range)."""
    rng = np.random.default_rng(zlib.crc32(f"iq2/degenerate/{qtype.name}".encode()))
    x = (rng.standard_normal((4, 256)) * 0.1).astype(np.float32)
    for importance in (np.zeros(256), np.full(256, 1e-30), 10.0 ** rng.uniform(-12, 12, 256)):
        importance = importance.astype(np.float32)
        ours = quantize_iq2(x, qtype, importance)
        assert np.array_equal(ours, _reference(x, qtype, importance).reshape(ours.shape))


@pytest.mark.parametrize("kind", KINDS)
def test_iq2_s_without_importance(kind):
    """IQ2_S alone quantizes without an importance matrix (weighting by sigma^2 / 4 + x^2)."""
    rng = np.random.default_rng(zlib.crc32(f"iq2/none/{kind}".encode()))
    x = _inputs(rng, kind, n=12, k=512).astype(np.float32)
    ours = quantize_iq2(x, T.IQ2_S, None)
    assert np.array_equal(ours, _reference(x, T.IQ2_S, None).reshape(ours.shape))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ2_XS], ids=lambda t: t.name)
def test_refuses_missing_importance(qtype):
    """llama.cpp asserts on a missing importance matrix for these two; we refuse."""
    assert libgguf.quantize_requires_imatrix(int(qtype))
    with pytest.raises(ValueError, match="importance matrix"):
        quantize_iq2(np.ones((1, 256), np.float32), qtype, None)


def test_refuses_bad_shapes():
    with pytest.raises(ValueError):
        quantize_iq2(np.zeros((2, 100), np.float32), T.IQ2_S, None)
    with pytest.raises(ValueError):
        quantize_iq2(np.zeros((2, 256), np.float32), T.IQ2_XS, np.ones(512, np.float32))
    with pytest.raises(ValueError):
        quantize_iq2(np.zeros((2, 256), np.float32), T.Q4_K, None)


def test_neighbour_tables():
    """Every reachable off-grid point has a non-empty list of entries, sorted by distance."""
    for qtype in IQ2_TYPES:
        levels, kmap, lists = tables(qtype)
        assert len(set(kmap[kmap >= 0])) == levels.shape[0]
        for u in (1, 0x5555, 0xAAAA, 0x1234 & 0xAAAA | 0x1):
            if kmap[u] >= 0:
                continue
            start = -1 - kmap[u]
            entries = lists[start + 1:start + 1 + lists[start]].astype(int)
            point = (u >> (2 * np.arange(8))) & 3
            d2 = ((levels[entries] - point) ** 2).sum(1)
            assert len(entries) and (np.diff(d2) >= 0).all()


def test_real_weights_bytes_identical(smollm_path):
    """Dequantized real SmolLM2 rows, with the column weights of their own squares (as libgguf
    makes when given none)."""
    from gguf_io import GGUFFile
    f = GGUFFile(smollm_path)
    name = "blk.3.ffn_down.weight"
    rows = dequantize(np.asarray(f.tensor_bytes(name)[:16]).reshape(-1), f.tensors[name].type)
    x = rows.reshape(16, -1).astype(np.float32)
    importance = np.sum(x * x, axis=0, dtype=np.float32)
    for qtype in IQ2_TYPES:
        ours = quantize_iq2(x, qtype, importance)
        assert np.array_equal(ours, _reference(x, qtype, importance).reshape(ours.shape)), qtype.name
    ours = quantize_iq2(x, T.IQ2_S, None)
    assert np.array_equal(ours, _reference(x, T.IQ2_S, None).reshape(ours.shape))
