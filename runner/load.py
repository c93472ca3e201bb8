"""Opening a GGUF model: file, hyperparameters, vocabulary, tokenizer and architecture on a backend."""
from __future__ import annotations

from dataclasses import dataclass

from gguf_io import GGUFError, GGUFFile, ModelParams, read_params, read_vocab

from .backend import make_backend
from .models.gemma3 import Gemma3
from .models.llama import Llama
from .models.qwen import Qwen2, Qwen3
from .tokenizer import Tokenizer
from .weights import WeightLoader

ARCHITECTURES = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3}


@dataclass
class LoadedModel:
    file: GGUFFile
    params: ModelParams
    tokenizer: Tokenizer
    model: object
    backend: object

    def default_context(self) -> int:
        return min(self.params.context_length, 4096)


def load_model(path, device: str = "cpu", threads: int | None = None, kv_type: str = "f32") -> LoadedModel:
    f = GGUFFile(path)
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path.name}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    params = read_params(f)
    tokenizer = Tokenizer(read_vocab(f))
    backend = make_backend(device, threads)
    model = ARCHITECTURES[arch](params, WeightLoader(f, backend), backend)
    model.kv_type = kv_type
    return LoadedModel(f, params, tokenizer, model, backend)
