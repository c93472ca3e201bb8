"""GGUF reading: a bounds-checked, memory-mapped file, its hyperparameters and vocabulary, and what
each architecture is (its declaration, shared with the converter)."""
from .architectures import ARCHITECTURES, Architecture, architecture
from .errors import GGUFError
from .file import GGUFFile
from .hparams import ModelParams, read_params
from .parser import MetadataValue, TensorInfo, ggml_dims
from .vocab import Vocab, read_vocab

__all__ = ["ARCHITECTURES", "Architecture", "GGUFError", "GGUFFile", "MetadataValue", "ModelParams", "TensorInfo",
           "Vocab", "architecture", "ggml_dims", "read_params", "read_vocab"]
