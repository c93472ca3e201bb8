"""The project's structure holds: one declaration per architecture, read by runner and converter
alike, and the package arrows (kernels never import models, backends never import each other,
the format layer never imports the runner or the converter, the converter never the runner; within
the runner, the server and the terminal sit on the engine, never under it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from gguf import MODEL_TENSORS

from gguf_io.architectures import ARCHITECTURES, HF_MODEL_TYPES
from runner.models import MODELS

ROOT = Path(__file__).parent.parent
FORBIDDEN = {"gguf_io": {"runner", "convert", "kernels_cpu", "kernels_gpu"}, "convert": {"runner"},
             "kernels_cpu": {"runner", "convert", "kernels_gpu"}, "kernels_gpu": {"runner", "convert", "kernels_cpu"}}


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_package_arrows_hold(package):
    offenders = {f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / package).rglob("*.py")
                 for name in _imported_packages(path) & FORBIDDEN[package]}
    assert not offenders


def test_every_declared_architecture_has_a_model_and_every_model_a_declaration():
    assert set(MODELS) == set(ARCHITECTURES)


def test_declarations_name_gguf_constants():
    for arch in ARCHITECTURES.values():
        assert arch.tensors == frozenset(MODEL_TENSORS[arch.gguf_arch])
        assert all(HF_MODEL_TYPES[t] is arch for t in arch.hf_model_types)


def test_a_model_loads_only_tensors_its_declaration_has(smollm_path, monkeypatch):
    """Every tensor name the model files ask for comes from the declaration (gguf's constants):
    SmolLM2's file has no tensor the Llama model leaves unread."""
    from gguf_io import GGUFFile
    from runner.engine.load import LoadOptions, load_model
    from runner.engine.weights import WeightLoader
    asked = []
    real = WeightLoader._info

    def recording(self, name, shape):
        asked.append(name)
        return real(self, name, shape)
    monkeypatch.setattr(WeightLoader, "_info", recording)
    load_model(smollm_path, LoadOptions(kv_type="f32"))
    assert set(asked) == set(GGUFFile(smollm_path).tensors)


def test_every_declared_weight_type_has_every_implementation():
    """One descriptor per type (gguf_io.quant_types); each implementation table covers them all."""
    from convert.quants import BLOCK_QUANTIZERS, ROW_QUANTIZERS
    from gguf import GGMLQuantizationType as T
    from gguf_io.quant_types import BLOCK_TYPES, FLOAT_TYPES, GRID_TYPES, QUANT_TYPES
    from kernels_cpu.block_ir import DECODERS
    from kernels_cpu.decoded_tiles import TILE_TYPES
    from kernels_cpu.interleaved import KINDS, LAYOUTS
    from kernels_cpu.rowdot_float import FLOAT_BYTES
    assert set(DECODERS) == BLOCK_TYPES
    # (the i-quants with grids and the ternary types keep the file's rows: prefill decodes eight
    # rows at a time for its bands of tokens, decode reads them row by row)
    assert set(KINDS) == set(LAYOUTS) == BLOCK_TYPES - set(GRID_TYPES) - {T.TQ1_0, T.TQ2_0}
    assert TILE_TYPES == set(GRID_TYPES) | {T.TQ1_0, T.TQ2_0}
    # (the i-quants with grids quantize row by row)
    assert not set(BLOCK_QUANTIZERS) & set(ROW_QUANTIZERS)
    assert set(BLOCK_QUANTIZERS) | set(ROW_QUANTIZERS) == BLOCK_TYPES
    assert set(FLOAT_BYTES) == FLOAT_TYPES
    assert all(q.fallback is None or QUANT_TYPES[q.fallback].block < q.block for q in QUANT_TYPES.values())
    torch = pytest.importorskip("torch")  # noqa: F841
    from kernels_gpu.dequant import DEQUANTIZE
    assert set(DEQUANTIZE) == set(QUANT_TYPES)


def test_partial_rope_is_declared_where_llama_cpp_rotates_part_of_a_head(llama_cpp_source):
    """Architecture.partial_rope, against llama.cpp's graphs: those that assert n_embd_head == n_rot
    rotate whole heads, and a file that says otherwise is refused (gguf_io.hparams)."""
    graph_files = {"gpt-oss": "openai-moe", "granitemoe": "granite-moe", "granitehybrid": "granite-hybrid"}
    for arch in ARCHITECTURES.values():
        graph = llama_cpp_source / "src" / "models" / f"{graph_files.get(arch.name, arch.name.replace('_', '-'))}.cpp"
        assert arch.partial_rope == ("GGML_ASSERT(n_embd_head == n_rot)" not in graph.read_text()), arch.name


def test_every_sampling_option_is_a_flag_and_settable_in_chat():
    from dataclasses import fields

    from runner.engine.sampler import SamplingOptions
    from runner.terminal.chat_repl import SETTABLE
    from runner.terminal.cli import _SAMPLING_FLAGS
    names = {f.name for f in fields(SamplingOptions)}
    assert set(_SAMPLING_FLAGS.values()) == names
    assert {field for field, _ in SETTABLE.values()} == names


def _absolute_imports(path: Path) -> set[str]:
    """The dotted names a file imports, relative imports resolved."""
    package = path.relative_to(ROOT).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def test_the_server_sits_on_the_engine():
    """runner/serve reaches the model through the engine (Session, sampler, tokenizer, chat
    templates), never into kernels or model code; nothing but the CLI imports it."""
    below = ("kernels_cpu", "kernels_gpu", "runner.models", "runner.engine.weights")
    serve = ROOT / "runner" / "serve"
    offenders = {f"{path.relative_to(ROOT)} imports {name}" for path in serve.rglob("*.py")
                 for name in _absolute_imports(path) if name.startswith(below)}
    assert not offenders
    users = {str(path.relative_to(ROOT)) for path in (ROOT / "runner").rglob("*.py")
             if serve not in path.parents and any(n.startswith("runner.serve") for n in _absolute_imports(path))}
    assert users == {"runner/terminal/cli.py"}


# runner's subpackages -> those they never import: the server and the terminal sit on the engine,
# never under it, and measuring is done to the engine from above; text and fetch stand on their own
# (the terminal may import any of them: its `serve` command starts the server)
RUNNER_NEVER_IMPORTS = {
    "engine": {"measure", "serve", "terminal"},
    "models": {"measure", "serve", "terminal"},
    "text": {"engine", "models", "measure", "serve", "terminal"},
    "fetch": {"engine", "text", "models", "measure", "serve", "terminal"},
    "measure": {"serve", "terminal"},
    "serve": {"terminal"},
    "terminal": set(),
}


@pytest.mark.parametrize("package", [p for p, never in RUNNER_NEVER_IMPORTS.items() if never])
def test_runner_subpackage_arrows_hold(package):
    forbidden = {f"runner.{name}" for name in RUNNER_NEVER_IMPORTS[package]}
    offenders = {f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / "runner" / package).rglob("*.py")
                 for name in _absolute_imports(path) if name.split(".")[0] == "runner"
                 and ".".join(name.split(".")[:2]) in forbidden}
    assert not offenders


def test_the_runner_is_grouped_by_concern():
    """Every module of runner/ lives in a subpackage that the arrows above cover; only the package's
    __init__ and __main__ stay at its top."""
    runner = ROOT / "runner"
    assert {path.name for path in runner.glob("*.py")} == {"__init__.py", "__main__.py"}
    assert {path.parent.name for path in runner.glob("*/__init__.py")} == set(RUNNER_NEVER_IMPORTS)
