"""IQ3_XXS and IQ3_S quantizers against llama.cpp's (libgguf): identical bytes, with and without an
importance vector."""
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.quants_iq3 import quantize_iq3, tables
from gguf_io.quant_types import grid

from .test_quants import _inputs

libgguf = pytest.importorskip("libgguf")

TYPES = [T.IQ3_XXS, T.IQ3_S]


def _reference(x, qtype, importance):
    return np.ascontiguousarray(libgguf.quantize_rows(x, int(qtype), imatrix=importance)).view(np.uint8)


def _zero_groups(rng, n, k):
    """Whole groups of 32 zero (IQ3_S's writes then shift, as llama.cpp's do), tiny groups, outliers."""
    x = rng.standard_normal((n, k))
    x[rng.uniform(0, 1, (n, k // 32)).repeat(32, axis=1) < 0.3] = 0.0
    x[1, :40] = 1e-12
    x[2] = 1e-30
    x[3, ::3] = 3e4
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "heavy", "positive", "sparse", "scales", "zero_groups"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_bytes_identical_to_llama_cpp(qtype, kind, weighted):
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}/{kind}/{weighted}".encode()))
    n, k = 8, 512
    x = (_zero_groups(rng, n, k) if kind == "zero_groups" else _inputs(rng, kind, n, k)).astype(np.float32)
    importance = None
    if weighted:  # as an imatrix's: positive, some columns never active
        importance = (rng.uniform(0, 3, k) * (rng.uniform(0, 1, k) > 0.1)).astype(np.float32)
    ours = quantize_iq3(x, qtype, importance)
    ref = _reference(x, qtype, importance).reshape(ours.shape)
    assert np.array_equal(ours, ref)
    assert np.isfinite(dequantize(ours.reshape(-1), qtype)).all()


def test_real_weights_bytes_identical(smollm_path):
    """Dequantized real SmolLM2 rows, with and without an importance vector."""
    from gguf_io import GGUFFile
    f = GGUFFile(smollm_path)
    name = "blk.3.ffn_down.weight"
    rows = dequantize(f.tensor_bytes(name)[:16].reshape(-1), f.tensors[name].type)
    x = np.ascontiguousarray(rows.reshape(16, -1).astype(np.float32))
    importance = (x * x).sum(axis=0) + np.float32(1e-3)
    for qtype in TYPES:
        for imp in (None, importance):
            ours = quantize_iq3(x, qtype, imp)
            assert np.array_equal(ours, _reference(x, qtype, imp).reshape(ours.shape)), qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tables(qtype):
    """Every grid entry maps back to itself; every other point has a non-empty list of neighbours."""
    qgrid, kmap, neighbours = tables(qtype)
    assert len(qgrid) == len(grid(qtype))
    levels = (qgrid.astype(int) - 1) // 2
    on = (levels << np.array([0, 3, 6, 9])).sum(axis=1)
    assert np.array_equal(kmap[on], np.arange(len(qgrid)))
    off = -kmap[kmap < 0] - 1
    assert (neighbours[off] > 0).all()


def test_refuses_bad_input():
    with pytest.raises(ValueError):
        quantize_iq3(np.zeros((2, 100), np.float32), T.IQ3_S, None)
    with pytest.raises(ValueError):
        quantize_iq3(np.zeros((2, 256), np.float32), T.IQ3_S, np.ones(128, np.float32))
    with pytest.raises(ValueError):
        quantize_iq3(np.zeros((2, 256), np.float32), T.Q4_K, None)
