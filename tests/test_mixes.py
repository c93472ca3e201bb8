"""ggrun's conversions and quant mixes against llama.cpp's own pipeline: its converter
(--outtype f32), then llama-quantize. On the real 30-layer SmolLM2 for every type ggrun writes;
on small mixtures of experts (tests/hf_folders.py) for the types whose rules experts change. The
references (tests/data/llama_cpp_mixes.json, llama_cpp_moe_mixes.json: per tensor its type and a
hash of its bytes, in llama-quantize's order) are made by scripts/llama_cpp_mixes from llama.cpp
b11434. With an importance matrix (made by ggrun imatrix or llama-imatrix, whose sums may differ by
machine in their last bits), llama-quantize runs beside ggrun in the test."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gguf import GGMLQuantizationType as T

from convert.mixes import FILE_TYPES, MixOptions
from gguf_io import GGUFFile

from .hf_folders import MOE_CONFIGS

REFERENCES = Path(__file__).parent / "data" / "llama_cpp_mixes.json"
MOE_REFERENCES = Path(__file__).parent / "data" / "llama_cpp_moe_mixes.json"
# the types whose choices a mixture changes: its 8-expert rules (attn_k/attn_v/attn_output), ffn_down
# counted by layer, the router kept in F32
MOE_TYPES = ("F32", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "IQ4_XS", "MXFP4_MOE")
# the mixes below 4 bits a weight (IQ1_S ... IQ3_M, TQ1_0, TQ2_0): llama-quantize writes most only with
# an importance matrix, so they are compared beside it (test_iquant_mixes_are_llama_quantizes), not
# against stored references
IQ_MIXES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
            "TQ1_0", "TQ2_0")
REFERENCE_TYPES = [t for t in FILE_TYPES if t not in IQ_MIXES]


# llama-quantize's options that change a mix: reference name -> (file type, its options as given to
# llama-quantize), each against SmolLM2, whose embedding is tied and whose rows of 576 weights take
# no 256-weight block (so that the fallbacks show)
VARIANTS = {"Q4_K_M --pure": ("Q4_K_M", ["--pure"]),
            "Q4_0 --output-tensor-type q6_k": ("Q4_0", ["--output-tensor-type", "q6_k"]),
            "IQ4_XS --token-embedding-type q4_1": ("IQ4_XS", ["--token-embedding-type", "q4_1"])}


def mix_options(args: list[str]) -> MixOptions:
    """The MixOptions of llama-quantize's arguments."""
    named = {"--output-tensor-type": "output_type", "--token-embedding-type": "token_embedding_type"}
    fields = {named[a]: T[b.upper()] for a, b in zip(args, args[1:]) if a in named}
    return MixOptions(pure="--pure" in args, **fields)


def tensor_digests(path) -> list[list[str]]:
    """[name, type, first 16 hex digits of the bytes' sha256] for each tensor, in file order."""
    f = GGUFFile(path)
    return [[name, t.type.name, hashlib.sha256(f.tensor_bytes(name).tobytes()).hexdigest()[:16]]
            for name, t in f.tensors.items()]


def _references() -> dict:
    return json.loads(REFERENCES.read_text())


def test_f32_conversion_equals_llama_cpps_converter(smollm_f32):
    assert sorted(tensor_digests(smollm_f32)) == sorted(_references()["F32"])


@pytest.mark.parametrize("file_type", [t for t in REFERENCE_TYPES if t != "F32"])
def test_mix_is_llama_cpps_through_convert_and_quantize(smollm_hf, smollm_f32, tmp_path, file_type):
    from convert.convert import convert_hf, requantize
    want = _references()[file_type]
    converted = tmp_path / "converted.gguf"
    convert_hf(smollm_hf, converted, file_type, progress=False)
    got = tensor_digests(converted)
    assert [d for d in sorted(got) if d not in want] == []
    quantized = tmp_path / "quantized.gguf"
    requantize(smollm_f32, quantized, file_type, progress=False)
    assert tensor_digests(quantized) == want  # written in llama-quantize's order too


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mix_options_are_llama_quantizes(smollm_hf, smollm_f32, tmp_path, variant):
    """--pure, --output-tensor-type and --token-embedding-type choose as llama-quantize does, through
    quantize (and, for one, convert)."""
    from convert.convert import convert_hf, requantize
    file_type, args = VARIANTS[variant]
    want = _references()[variant]
    quantized = tmp_path / "quantized.gguf"
    requantize(smollm_f32, quantized, file_type, progress=False, mix=mix_options(args))
    assert tensor_digests(quantized) == want
    if variant == next(iter(VARIANTS)):
        convert_hf(smollm_hf, tmp_path / "converted.gguf", file_type, progress=False, mix=mix_options(args))
        assert sorted(tensor_digests(tmp_path / "converted.gguf")) == sorted(want)


# (file type, llama-quantize's options besides --imatrix) quantized with an importance matrix
IMATRIX_RUNS = (("Q4_K_M", []), ("Q4_0", ["--include-weights", "attn_", "--include-weights", "ffn_up"]))


def _imatrix_of(model, tmp_path) -> Path:
    """ggrun imatrix's matrix of model over 2 chunks of 128 tokens."""
    from click.testing import CliRunner

    from runner.terminal.cli import main

    from .llama_cpp import PERPLEXITY_TEXT
    text, imatrix = tmp_path / "text.txt", tmp_path / "imatrix.gguf"
    text.write_text(PERPLEXITY_TEXT)
    r = CliRunner().invoke(main, ["imatrix", str(model), "-f", str(text), "-o", str(imatrix), "-c", "128", "--chunks", "2"])
    assert r.exit_code == 0, r.output
    return imatrix


def _quantized_alike(tools, f32, imatrix, file_type, args, mix, tmp_path) -> list:
    """llama-quantize's and ggrun's quantization of f32 with imatrix (theirs.gguf, ours.gguf): the digests."""
    import subprocess

    from convert.convert import requantize
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    subprocess.run([tools / "llama-quantize", "--imatrix", imatrix, *args, f32, theirs, file_type],
                   check=True, capture_output=True, timeout=300)
    requantize(f32, ours, file_type, progress=False, mix=mix)
    want = tensor_digests(theirs)
    assert tensor_digests(ours) == want, file_type
    return want


def test_mixes_with_an_importance_matrix_are_llama_quantizes(smollm_hf, smollm_f32, llama_cpp_tools, tmp_path):
    """An importance matrix made by ggrun imatrix (2 chunks of 128 tokens), given to llama-quantize
    b11434 and to ggrun: the same bytes, through quantize and convert, and the same quantize.imatrix.*
    keys. Q4_0 with --include-weights: only the matching tensors weighed, and ffn_down's first eighth
    Q4_1, as llama-quantize chooses with an importance matrix."""
    from convert.convert import convert_hf
    imatrix = _imatrix_of(smollm_f32, tmp_path)
    for file_type, args in IMATRIX_RUNS:
        mix = MixOptions(imatrix=str(imatrix), include_weights=tuple(args[1::2]))
        want = _quantized_alike(llama_cpp_tools, smollm_f32, imatrix, file_type, args, mix, tmp_path)
        ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
        keys = [{k: v.value for k, v in GGUFFile(p).metadata.items() if k.startswith("quantize.")} for p in (ours, theirs)]
        assert keys[0] == keys[1] and keys[0]["quantize.imatrix.file"] == str(imatrix), file_type
        if file_type == "Q4_K_M":
            convert_hf(smollm_hf, tmp_path / "converted.gguf", file_type, progress=False, mix=mix)
            assert sorted(tensor_digests(tmp_path / "converted.gguf")) == sorted(want)


def test_experts_take_their_own_importance_as_in_llama_quantize(llama_cpp_source, llama_cpp_tools, tmp_path):
    """A mixture's 3-D expert tensors: each expert's rows weighed by its own slice of the matrix."""
    from convert.convert import convert_hf

    from .hf_folders import moe_folder
    f32 = tmp_path / "f32.gguf"
    convert_hf(moe_folder("qwen3_moe", tmp_path / "hf", llama_cpp_source), f32, "F32", progress=False)
    imatrix = _imatrix_of(f32, tmp_path)
    for file_type in ("Q2_K", "Q4_K_M", "IQ4_XS"):
        _quantized_alike(llama_cpp_tools, f32, imatrix, file_type, [], MixOptions(imatrix=str(imatrix)), tmp_path)


def test_a_named_type_that_cannot_hold_the_rows_is_refused(smollm_f32, tmp_path):
    from convert.convert import requantize
    from convert.errors import ConversionError
    with pytest.raises(ConversionError, match=r"--token-embedding-type Q4_K: token_embd.weight's rows of 576"):
        requantize(smollm_f32, tmp_path / "q.gguf", "Q4_0", progress=False,
                   mix=MixOptions(token_embedding_type=T.Q4_K))
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_conversion_and_mixes_are_llama_cpps(moe_folders, tmp_path, arch):
    """Experts stacked into 3-D tensors byte for byte as llama.cpp's converter writes them, and
    quantized as llama-quantize types and quantizes them."""
    from convert.convert import convert_hf, requantize
    want = json.loads(MOE_REFERENCES.read_text())[arch]
    f32 = tmp_path / "f32.gguf"
    convert_hf(moe_folders[arch], f32, "F32", progress=False)
    assert sorted(tensor_digests(f32)) == sorted(want["F32"])
    for file_type in MOE_TYPES[1:]:
        quantized = tmp_path / f"{file_type}.gguf"
        requantize(f32, quantized, file_type, progress=False)
        assert tensor_digests(quantized) == want[file_type], file_type
        quantized.unlink()



@pytest.fixture(scope="module")
def llama_256(tmp_path_factory):
    """An 8-layer Llama F32 whose rows are whole super-blocks (256 and 512 weights), two queries a KV head."""
    from convert.random_model import LlamaShape, write_random_llama
    f32 = tmp_path_factory.mktemp("llama-256") / "f32.gguf"
    write_random_llama(f32, LlamaShape(n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=512,
                                       context_length=256), "F32", progress=False, tiled=False)
    return f32


def test_iquant_mixes_are_llama_quantizes(llama_256, llama_cpp_tools, tmp_path):
    """Every i-quant and ternary mix, with an importance matrix made by ggrun imatrix: the bytes
    llama-quantize b11434 writes."""
    imatrix = _imatrix_of(llama_256, tmp_path)
    for file_type in IQ_MIXES:
        _quantized_alike(llama_cpp_tools, llama_256, imatrix, file_type, [], MixOptions(imatrix=str(imatrix)), tmp_path)


def test_an_iquant_mix_through_convert_with_llama_imatrixs_matrix(llama_cpp_source, llama_cpp_tools, tmp_path):
    """A Hugging Face folder converted straight to an i-quant mix with the importance matrix that
    llama-imatrix b11434 made: the bytes llama-quantize writes from the F32 file (ggrun's F32
    conversion is llama.cpp's converter's: test_convert)."""
    import subprocess

    from convert.convert import convert_hf

    from .hf_folders import random_folder
    from .llama_cpp import PERPLEXITY_TEXT
    folder = random_folder("llama", tmp_path / "hf", llama_cpp_source)
    f32, text, imatrix = tmp_path / "f32.gguf", tmp_path / "text.txt", tmp_path / "imatrix.gguf"
    convert_hf(folder, f32, "F32", progress=False)
    text.write_text(PERPLEXITY_TEXT)
    subprocess.run([llama_cpp_tools / "llama-imatrix", "-m", f32, "-f", text, "-o", imatrix, "-c", "128", "--chunks",
                    "2", "--no-ppl"], capture_output=True, check=True, timeout=300)
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    # (IQ2_M: IQ2_S and IQ3_S with the low-bit mixes' promotions; every mix goes through quantize above)
    subprocess.run([llama_cpp_tools / "llama-quantize", "--imatrix", imatrix, f32, theirs, "IQ2_M"],
                   check=True, capture_output=True, timeout=300)
    convert_hf(folder, ours, "IQ2_M", progress=False, mix=MixOptions(imatrix=str(imatrix)))
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))


def test_types_that_need_an_importance_matrix_are_refused_without_one(llama_256, tmp_path):
    """As llama-quantize refuses them, before anything is written, saying how to make one."""
    from convert.convert import requantize
    from convert.errors import ConversionError
    for file_type in ("IQ2_XXS", "IQ1_M", "IQ3_XXS"):
        with pytest.raises(ConversionError, match=r"needs an importance matrix.*ggrun imatrix"):
            requantize(llama_256, tmp_path / "q.gguf", file_type, progress=False)
        assert not (tmp_path / "q.gguf").exists()
