"""llama-quantize's importance matrix (--imatrix, --include-weights, --exclude-weights): per tensor
name, the columns' means that its quantizer weighs errors by; which tensors take them; the keys that
name the matrix in the output file (tools/quantize/quantize.cpp, src/llama-quant.cpp)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from gguf_io import GGUFError
from gguf_io.imatrix import ImatrixEntry, read_imatrix

from .errors import ConversionError

# the keys llama-quantize writes into a file it quantizes with an importance matrix
FILE_KEY, DATASET_KEY = "quantize.imatrix.file", "quantize.imatrix.dataset"
ENTRIES_KEY, CHUNKS_KEY = "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"
_KEY_CHARS = 127  # (llama-quantize copies strings into a 128-byte override value)
_TOKEN_EMBEDDINGS = ("token_embd.weight", "per_layer_token_embd.weight")
# the types llama-quantize writes only with an importance matrix (but for the token embedding and
# the output: llama-quant.cpp's tensor_requires_imatrix), and those whose quantizers cannot run
# without one at all
_NEEDS_IMPORTANCE = frozenset({T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS})
_CANNOT_RUN_WITHOUT = frozenset({T.IQ1_S, T.IQ2_XXS, T.IQ2_XS})
HOW_TO_MAKE_ONE = "make one with `ggrun imatrix MODEL -f TEXT -o imatrix.gguf` and pass --imatrix imatrix.gguf"


def needs_importance(qtype: T) -> bool:
    """Whether llama-quantize writes a mix of this default type only with an importance matrix."""
    return qtype in _NEEDS_IMPORTANCE


@dataclass
class Importance:
    values: dict[str, np.ndarray]  # tensor name -> float32 means, (experts, columns) flattened
    file: str                      # the file as it was named
    datasets: list[str]
    chunk_count: int

    def for_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The means a tensor of GGML shape `shape` is quantized with, (experts, columns): None where
        the matrix has no entry for it, or where the token embedding's does not fit (llama-quantize
        quantizes it without); ConversionError where another tensor's does not fit."""
        values = self.values.get(name)
        if values is None:
            return None
        n_expert = shape[2] if len(shape) > 2 else 1
        if values.size != shape[0] * n_expert:
            if name in _TOKEN_EMBEDDINGS:
                return None
            experts = f" in each of {n_expert} experts" if n_expert > 1 else ""
            raise ConversionError(f"the importance matrix {self.file} holds {values.size} values for {name}, which "
                                  f"has {shape[0]} columns{experts}: it was made for another model")
        return values.reshape(n_expert, shape[0])

    def metadata(self) -> list[tuple[str, object, GGUFValueType, None]]:
        """The quantize.imatrix.* keys, as llama-quantize writes them (strings cut to 127 characters)."""
        keys = [(FILE_KEY, self.file[:_KEY_CHARS], GGUFValueType.STRING, None)]
        if self.datasets:  # (the first only, as llama-quantize writes)
            keys.append((DATASET_KEY, self.datasets[0][:_KEY_CHARS], GGUFValueType.STRING, None))
        keys.append((ENTRIES_KEY, len(self.values), GGUFValueType.UINT32, None))
        if self.chunk_count > 0:
            keys.append((CHUNKS_KEY, self.chunk_count, GGUFValueType.UINT32, None))
        return keys


def _means(entry: ImatrixEntry, legacy: bool) -> np.ndarray:
    """llama-quantize's per-column values: a GGUF file's sums over their counts (1 where a count is 0,
    per expert), a .dat file's values over its count of chunks (as they are where that is 0)."""
    if legacy:
        count = np.float32(entry.counts[0])
        return entry.sums.reshape(-1) / count if count > 0 else entry.sums.reshape(-1).copy()
    counts = entry.counts.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        means = np.where(counts > 0, entry.sums / np.where(counts > 0, counts, np.float32(1)), np.float32(1))
    return means.astype(np.float32).reshape(-1)


def load_importance(path: str | None, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> Importance | None:
    """The importance matrix of file `path` (GGUF or legacy .dat), less the entries whose names contain
    one of `exclude`, or with only those containing one of `include`; None where there is no file or
    no entry is left (then nothing is quantized with one, as llama-quantize does)."""
    if path is None:
        return None
    if include and exclude:
        raise ConversionError("--include-weights and --exclude-weights cannot be used together")
    try:
        imatrix = read_imatrix(path)
    except GGUFError as e:
        raise ConversionError(f"cannot read the importance matrix {path}: {e}") from None
    if not imatrix.legacy and not imatrix.has_metadata:
        raise ConversionError(f"{path} lacks the imatrix.datasets, imatrix.chunk_count and imatrix.chunk_size keys "
                              f"of an importance matrix")
    values = {name: _means(e, imatrix.legacy) for name, e in imatrix.entries.items()}
    values = {name: v for name, v in values.items() if not any(part in name for part in exclude)}
    if include:
        values = {name: v for name, v in values.items() if any(part in name for part in include)}
    for name, v in values.items():
        if not np.isfinite(v).all():
            raise ConversionError(f"the importance matrix {path} has a value that is not finite for {name}")
    return Importance(values, str(path), imatrix.datasets, imatrix.chunk_count) if values else None


def check_importance(tensors, importance: Importance | None) -> None:
    """ConversionError, before anything is written, where a tensor would be written in a type that
    needs an importance matrix without one (PlannedTensors: name, type, imatrix)."""
    for t in tensors:
        exempt = t.name in (*_TOKEN_EMBEDDINGS, "output.weight") and t.type not in _CANNOT_RUN_WITHOUT
        if t.imatrix is not None or t.type not in _NEEDS_IMPORTANCE or exempt or t.quantized:
            continue
        if importance is None:
            raise ConversionError(f"{t.type.name} ({t.name}) needs an importance matrix, as in llama-quantize: "
                                  f"{HOW_TO_MAKE_ONE}")
        raise ConversionError(f"the importance matrix {importance.file} has no entry for {t.name}, which "
                              f"{t.type.name} needs (made for another model, or left out by --include-weights "
                              f"or --exclude-weights)")
