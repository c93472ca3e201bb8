"""Opening a GGUF model: file, hyperparameters, vocabulary, tokenizer and architecture on a backend."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from gguf_io import GGUFFile, ModelParams, architecture, read_params, read_vocab

from .backend import BackendError, make_backend
from .kv_cache import DEFAULT_CONTEXT
from .memory_fit import MemoryFit
from .models import MODELS
from .tokenizer import Tokenizer
from .weights import WeightLoader


def default_context(params: ModelParams) -> int:
    return min(params.context_length, DEFAULT_CONTEXT)


@dataclass
class LoadedModel:
    file: GGUFFile
    params: ModelParams
    tokenizer: Tokenizer
    model: object
    backend: object

    def default_context(self) -> int:
        return default_context(self.params)

    def identity(self) -> str:
        """What a saved KV state belongs to: the file's size and a digest of its first MiB (the
        header, the tensor table and the start of the weights)."""
        with open(self.file.path, "rb") as f:
            head = f.read(1 << 20)
        return f"{self.file.path.stat().st_size}:{hashlib.sha256(head).hexdigest()[:32]}"


def memory_fit(f: GGUFFile, params: ModelParams, kv_type: str) -> MemoryFit:
    """The memory arithmetic of a file, with its architecture's sliding windows."""
    return MemoryFit.of(f, params, kv_type)


def _check_fit(f: GGUFFile, params: ModelParams, backend, kv_type: str, n_ctx: int) -> None:
    """On a device with its own memory, refuse a model whose weights and KV cache exceed what is
    free, saying how much it needs (before uploading anything)."""
    free = backend.free_memory()
    if free is None:
        return
    fit = memory_fit(f, params, kv_type)
    need = fit.total_bytes(n_ctx)
    if need > free:
        gib = 2**30
        raise BackendError(f"{f.path.name} needs {need / gib:.2f} GiB on {backend.name} (weights "
                           f"{fit.weight_bytes / gib:.2f} GiB + {kv_type} KV cache {fit.kv_bytes(n_ctx) / gib:.2f} GiB "
                           f"at context {n_ctx}) but {free / gib:.2f} GiB are free; try a smaller -c or --device cpu")


def _check_kv_type(params: ModelParams, backend, kv_type: str) -> None:
    if kv_type not in backend.kv_types:
        raise BackendError(f"the {backend.name} backend keeps its KV cache as {' or '.join(backend.kv_types)}, "
                           f"not {kv_type}")
    block = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
    sizes = sorted({size for i in range(params.n_layer)
                    for size in (params.layer_head_dim(i), params.layer_value_dim(i))})
    if kv_type == "q8_0" and any(size % block for size in sizes):
        raise BackendError(f"a q8_0 KV cache needs head sizes that are multiples of {block}; this model's are "
                           f"{'/'.join(map(str, sizes))}: use f16")


def load_model(path, device: str = "cpu", threads: int | None = None, kv_type: str = "f32",
               n_ctx: int | None = None, precise: bool = False) -> LoadedModel:
    """The model on a backend; n_ctx (default: the model's default context) sizes the memory check
    of devices with their own memory; precise: see make_backend."""
    f = GGUFFile(path)
    arch = architecture(f.architecture, f"{f.path.name}: ")
    params = read_params(f)
    tokenizer = Tokenizer(read_vocab(f))
    backend = make_backend(device, threads, precise)
    _check_kv_type(params, backend, kv_type)
    _check_fit(f, params, backend, kv_type, n_ctx or default_context(params))
    weights = WeightLoader(f, backend, arch)
    model = MODELS[arch.name](params, weights, backend)
    weights.check_all_read()
    model.kv_type = kv_type
    return LoadedModel(f, params, tokenizer, model, backend)
