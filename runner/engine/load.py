"""Opening a GGUF model: file, hyperparameters, vocabulary, tokenizer and architecture on a backend."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from gguf_io import GGUFFile, ModelParams, architecture, read_params, read_vocab

from ..models import MODELS
from ..text.tokenizer import Tokenizer
from .backend import BackendError, make_backend
from .kv_cache import DEFAULT_CONTEXT, MIN_CONTEXT
from .memory_fit import MemoryFit, MemoryFitError, available_host_memory
from .weights import WeightLoader


def default_context(params: ModelParams) -> int:
    return max(MIN_CONTEXT, min(params.context_length, DEFAULT_CONTEXT))


@dataclass
class LoadedModel:
    file: GGUFFile
    params: ModelParams
    tokenizer: Tokenizer
    model: object
    backend: object

    def default_context(self) -> int:
        return default_context(self.params)

    def context_warning(self, n_ctx: int) -> str | None:
        """What a user should know of a context longer than the model was trained on."""
        trained = self.params.context_length
        if n_ctx <= trained:
            return None
        return (f"the context of {n_ctx} tokens is longer than the {trained} this model was trained on: "
                f"past {trained} tokens its output may degrade")

    def identity(self) -> str:
        """What a saved KV state belongs to: the file's size and a digest of its first MiB (the
        header, the tensor table and the start of the weights)."""
        with open(self.file.path, "rb") as f:
            head = f.read(1 << 20)
        return f"{self.file.path.stat().st_size}:{hashlib.sha256(head).hexdigest()[:32]}"


def memory_fit(f: GGUFFile, params: ModelParams, kv_type: str) -> MemoryFit:
    """The memory arithmetic of a file, with its architecture's sliding windows and recurrent state."""
    shapes = MODELS[params.arch].state_shapes(params)
    per_layer = sum(math.prod(shape) for shape in shapes.values()) * np.dtype(np.float32).itemsize
    return MemoryFit.of(f, params, kv_type, per_layer * sum(map(params.recurrent, range(params.n_layer))))


def _check_fit(f: GGUFFile, params: ModelParams, backend, kv_type: str, n_ctx: int, states: int) -> None:
    """Refuse, before anything is allocated, a model whose KV cache and recurrent states (and on a
    device with its own memory, weights) exceed the memory free for them, saying how much it needs
    and the longest context that fits. On the host the weights are mapped from the file, not
    allocated."""
    fit = memory_fit(f, params, kv_type)
    device_free = backend.free_memory()
    on_device = device_free is not None
    free = device_free if on_device else available_host_memory()
    need = fit.total_bytes(n_ctx, states=states) if on_device else fit.cache_bytes(n_ctx, states=states)
    if free is None or need <= free:
        return
    gib = 2**30
    needs = (f"weights {fit.weight_bytes / gib:.2f} GiB + " if on_device else "") + \
        f"{kv_type} KV cache {fit.kv_bytes(n_ctx) / gib:.2f} GiB at context {n_ctx}" + \
        (f" + recurrent states {states * fit.state_bytes / gib:.2f} GiB" if fit.state_bytes else "")
    best = fit.max_context(free, weights=on_device, states=states)
    advice = f"the longest context that fits is {best} tokens (-c)" if best >= MIN_CONTEXT else "nothing fits"
    raise MemoryFitError(f"{f.path.name} needs {needs}, but {free / gib:.2f} GiB are free on {backend.name}: "
                         f"{advice}" + ("; or try --device cpu" if on_device else ""))


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


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded, built by keyword; each default is defined here alone."""
    device: str = "cpu"          # a resolved device (backend.resolve_device): cpu, cuda or torch-cpu
    threads: int | None = None   # CPU threads (None: all cores)
    kv_type: str = "f16"         # the KV cache's type: f16, f32 (exact) or q8_0
    n_ctx: int | None = None     # the context the memory check sizes the cache for (None: the model's default)
    kv_tokens: int | None = None  # the KV tokens the memory check sizes for, where a server's pool holds more (None: n_ctx)
    states: int = 1              # a hybrid's recurrent states the memory check counts (a server's: more)
    precise: bool = False        # see backend.make_backend


def load_model(path, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """The model on a backend, its memory checked for options.n_ctx tokens of context."""
    f = GGUFFile(path)
    arch = architecture(f.architecture, f"{f.path.name}: ")
    params = read_params(f)
    tokenizer = Tokenizer(read_vocab(f))
    backend = make_backend(options.device, options.threads, options.precise)
    _check_kv_type(params, backend, options.kv_type)
    _check_fit(f, params, backend, options.kv_type, options.kv_tokens or options.n_ctx or default_context(params),
               options.states)
    weights = WeightLoader(f, backend, arch)
    model = MODELS[arch.name](params, weights, backend)
    weights.check_all_read()
    model.kv_type = options.kv_type
    model.weight_names = weights.names
    return LoadedModel(f, params, tokenizer, model, backend)
