"""GGUF reading: a bounds-checked, memory-mapped file, its hyperparameters and vocabulary."""
from .errors import GGUFError
from .file import GGUFFile
from .hparams import ModelParams, read_params
from .parser import MetadataValue, TensorInfo
from .vocab import Vocab, read_vocab

__all__ = ["GGUFError", "GGUFFile", "MetadataValue", "ModelParams", "TensorInfo", "Vocab",
           "read_params", "read_vocab"]
