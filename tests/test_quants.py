"""Our quantizers against llama.cpp's reference quantizers (libgguf): identical bytes."""
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.quants import BLOCK_QUANTIZERS, quantize
from gguf_io.quant_types import FLOAT_TYPES, QUANT_TYPES

libgguf = pytest.importorskip("libgguf")

# (F32 is stored as it is; the i-quants below IQ4 have no quantizer yet)
TYPES = [t for t in QUANT_TYPES if t != T.F32 and (t in FLOAT_TYPES or t in BLOCK_QUANTIZERS)]


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


def test_real_weights_bytes_identical(smollm):
    """Dequantized real SmolLM2 rows requantized to every type."""
    from gguf.quants import dequantize as deq
    f = smollm.file
    rows = deq(f.tensor_bytes("blk.3.ffn_down.weight")[:64].reshape(-1), f.tensors["blk.3.ffn_down.weight"].type)
    x = rows.reshape(64, -1)[:, :1536].astype(np.float32)
    for qtype in TYPES:
        ours = quantize(x, qtype)
        ref = np.ascontiguousarray(libgguf.quantize_rows(x, int(qtype))).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, ref), qtype.name


def test_refuses_bad_row_length():
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 100), np.float32), T.Q4_K)
