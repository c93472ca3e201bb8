"""Shared fixtures: the real models from PyPI (downloaded once into ggrun's cache) and oracles."""
from __future__ import annotations

import os

import pytest

from runner.fetch.registry import resolve

# Triton's kernels (kernels_gpu/triton_products.py) run on the CPU in its interpreter, which is
# chosen when they are defined: before any test imports them. On CUDA they compile as for users.
if os.environ.get("GGRUN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm_path():
    return resolve("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def gemma_path():
    return resolve("gemma3-270m", quiet=True)


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from runner.engine.load import LoadOptions, load_model
    return load_model(smollm_path, LoadOptions(kv_type="f32"))


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    # transformers' GGUF loader ignores tokenizer.ggml.pre and splits with plain GPT-2 rules; SmolLM2's
    # published tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split digits first. Restore it.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.fixture(scope="session")
def smollm_hf(smollm_path, tmp_path_factory):
    """The real SmolLM2 weights as a Hugging Face folder."""
    pytest.importorskip("transformers")
    from .hf_folders import smollm_folder
    return smollm_folder(smollm_path, tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="session")
def smollm_f32(smollm_hf, tmp_path_factory):
    """That folder converted to an F32 GGUF by ggrun."""
    from convert.convert import convert_hf
    out = tmp_path_factory.mktemp("smollm2-f32") / "smollm2-f32.gguf"
    convert_hf(smollm_hf, out, "F32", progress=False)
    return out


@pytest.fixture(scope="session")
def random_models(llama_cpp_source, tmp_path_factory):
    """Random-initialized Hugging Face folders of each architecture, as transformers builds them."""
    from .hf_folders import RANDOM_ARCHS, random_folder
    root = tmp_path_factory.mktemp("random")
    return {arch: random_folder(arch, root / arch, llama_cpp_source)
            for arch in RANDOM_ARCHS}


@pytest.fixture(scope="session")
def moe_folders(llama_cpp_source, tmp_path_factory):
    """Small Hugging Face mixtures of experts (hf_folders.MOE_CONFIGS), by model_type."""
    from .hf_folders import MOE_CONFIGS, moe_folder
    root = tmp_path_factory.mktemp("moe")
    return {arch: moe_folder(arch, root / arch, llama_cpp_source) for arch in MOE_CONFIGS}


@pytest.fixture(scope="session")
def hybrid_folders(llama_cpp_source, tmp_path_factory):
    """Small Hugging Face hybrids (hf_folders.HYBRID_CONFIGS), by model_type."""
    from .hf_folders import HYBRID_CONFIGS, hybrid_folder
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: hybrid_folder(arch, root / arch, llama_cpp_source) for arch in HYBRID_CONFIGS}


def hf_logits_function(gguf_path):
    """transformers loading the GGUF, dequantized to fp32: ids -> logits (T, vocab). The oracle."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)

    def logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()
    return logits


@pytest.fixture(scope="session")
def llama_cpp_source():
    """llama.cpp b11434's source tree (runner.fetch.registry.llama_cpp_source: fetched once into the cache)."""
    from runner.fetch.registry import llama_cpp_source
    return llama_cpp_source()


@pytest.fixture(scope="session")
def ggml_base(llama_cpp_source):
    """llama.cpp's libggml-base (its reference quantizers: quantize_row_q8_0_ref, _q8_K_ref ...),
    built once from the source package into the cache (~10 s; needs cmake and a C compiler)."""
    import ctypes
    import shutil
    import subprocess
    if shutil.which("cmake") is None:
        pytest.skip("cmake is needed to build llama.cpp's ggml-base")
    build = llama_cpp_source.parent.parent / "build-ggml-base"
    library = build / "bin" / "libggml-base.so"
    if not library.exists():
        subprocess.run(["cmake", "-S", str(llama_cpp_source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                       check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "ggml-base", "-j", "2"], check=True,
                       capture_output=True)
    return ctypes.CDLL(str(library))


@pytest.fixture(scope="session")
def llama_cpp_tools():
    """The folder of llama.cpp b11434's tools (llama-perplexity ...), built once into the cache by
    scripts/build_llama_cpp for AVX2 (portable, no AMX: these tests compare results, not speed);
    skipped where cmake or a C++ compiler is missing. The first build takes ~10 minutes on 2 cores."""
    import os
    import shutil
    import subprocess
    from pathlib import Path
    if shutil.which("cmake") is None or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("cmake and a C++ compiler are needed to build llama.cpp")
    script = Path(__file__).parent.parent / "scripts" / "build_llama_cpp"
    built = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                           env={**os.environ, "GGRUN_LLAMA_CPP_AVX2": "1"})
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.strip().splitlines()[-1])


# The slow tier: tests that read the PyPI models (downloaded once into the cache) or build from
# them, and tests that run llama.cpp's compiled tools (built once, ~10 minutes on 2 cores).
# Everything else is the fast tier: `pytest -m "not real_model and not llama_cpp_tools"`.
REAL_MODELS = {"smollm_path", "gemma_path"}


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: reads SmolLM2 or Gemma 3 (the fast tier leaves it out)")
    config.addinivalue_line("markers", "llama_cpp_tools: runs llama.cpp's built tools (the fast tier leaves it out)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(item, "callspec", None)
        asked = set(item.fixturenames) | {v for v in (params.params.values() if params else ()) if isinstance(v, str)}
        if asked & REAL_MODELS:
            item.add_marker(pytest.mark.real_model)
        if "llama_cpp_tools" in asked:
            item.add_marker(pytest.mark.llama_cpp_tools)
