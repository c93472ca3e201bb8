"""A whole model whose matrices are IQ4_XS and IQ4_NL (token embedding and output included) runs as
the function of its own weights widened back to F32: prefill's many tokens and decode's one, on
the CPU backend's paths and on the torch backend; and as llama.cpp runs the file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType
from gguf.quants import dequantize

from convert.quants import quantize
from convert.random_model import LlamaShape, write_random_llama
from runner.engine.load import LoadOptions, load_model

from .gguf_copy import rewritten
from .llama_cpp import PERPLEXITY_TEXT, llama_cpp_perplexity


def _iq4_type(name, rows):
    """IQ4_NL for the token embedding (read by rows), layer 1 and rows that are not whole
    super-blocks (llama.cpp's fallback), IQ4_XS for the rest."""
    return T.IQ4_NL if rows.shape[1] % 256 or ".1." in name or name == "token_embd.weight" else T.IQ4_XS


@pytest.fixture(scope="module")
def iq4_models(tmp_path_factory):
    """(the IQ4 model, its weights widened to F32)."""
    root = tmp_path_factory.mktemp("iq4")
    shape = LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=544, vocab_size=320, context_length=256)
    write_random_llama(root / "f32.gguf", shape, "F32", progress=False, tiled=False)
    types = {}

    def iq4(name, rows):
        types[name] = _iq4_type(name, rows)
        return types[name], quantize(rows, types[name])

    def widened(name, rows):
        return T.F32, dequantize(quantize(rows, types[name]).reshape(-1), types[name]).reshape(rows.shape)
    rewritten(root / "f32.gguf", root / "iq4.gguf", {"general.file_type": int(LlamaFileType.MOSTLY_IQ4_XS)}, iq4)
    rewritten(root / "f32.gguf", root / "widened.gguf", {}, widened)
    assert {T.IQ4_NL, T.IQ4_XS} == set(types.values())
    return root / "iq4.gguf", root / "widened.gguf"


def _logits(path, ids, **options):
    """Prefill's logits of ids, then decode's of one more token."""
    lm = load_model(path, LoadOptions(kv_type="f32", **options))
    cache = lm.model.new_cache(len(ids) + 2)
    prefill = lm.model.forward(ids[:-1], cache, all_logits=True)
    return np.concatenate([np.asarray(prefill), np.asarray(lm.model.forward(ids[-1:], cache)).reshape(1, -1)])


@pytest.mark.parametrize("options", [{}, {"precise": True}, {"device": "torch-cpu"}], ids=["int8", "precise", "torch"])
def test_an_iq4_model_computes_its_own_weights(iq4_models, options):
    if options.get("device") == "torch-cpu":
        pytest.importorskip("torch")
    iq4, widened = iq4_models
    ids = np.random.default_rng(1).integers(0, 320, 41).tolist()
    exact = _logits(widened, ids, precise=True)
    got = _logits(iq4, ids, **options)
    # (8-bit activations round as llama.cpp's do; the precise path and torch's float32 keep them)
    assert np.corrcoef(got.ravel(), exact.ravel())[0, 1] > (0.999 if not options else 0.99999)


def test_llama_cpp_computes_the_iq4_file_alike(iq4_models, llama_cpp_tools, tmp_path):
    """llama-perplexity on the IQ4 file is ggrun's: both round activations to Q8_0 and Q8_K blocks
    and sum the products as integers (F32 caches, no flash attention's float16 products)."""
    from runner.measure.perplexity import perplexity
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs = llama_cpp_perplexity(llama_cpp_tools, iq4_models[0], tmp_path / "text.txt")
    ours = perplexity(load_model(iq4_models[0], LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128, progress=False).ppl
    assert abs(ours / theirs - 1) < 1e-4, (ours, theirs)
