"""Writing a GGUF file tensor by tensor (gguf.GGUFWriter), atomically: a failure leaves no output."""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as T

from gguf_io.progress import progress_bar
from gguf_io.quant_types import BLOCK_TYPES
from gguf_io.safe_files import OutputError, atomic_outputs, same_file
from gguf_io.split import parse_part_name

from .errors import ConversionError
from .quants import quantize, quantizers_compiled


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]          # GGML order: shape[0] is the row length
    type: T
    load: Callable[[], np.ndarray]  # float32 data in numpy order, read only when written
    quantized: bool = False         # load returns the bytes of `type`'s blocks, written as they are
    imatrix: np.ndarray | None = None  # the importance of its columns, (experts, columns), to quantize with

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


@dataclass
class Summary:
    path: Path
    seconds: float
    n_params: int
    nbytes: int
    by_type: Counter = field(default_factory=Counter)
    parts: list[Path] = field(default_factory=list)  # the files written: [path], or a split model's parts
    left_out: list[str] = field(default_factory=list)  # the checkpoint's parts left out: "2 tensors of ..."

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(self.n_params, 1)

    def lines(self) -> list[str]:
        types = ", ".join(f"{n} {t}" for t, n in self.by_type.most_common())
        return [f"wrote {', '.join(map(str, self.parts))}",
                f"tensors: {types}",
                f"size: {sum(os.path.getsize(p) for p in self.parts) / 2**20:.1f} MiB, "
                f"{self.n_params / 1e6:.1f} M parameters, "
                f"{self.bits_per_weight:.2f} bits per weight, {self.seconds:.1f} s"] + (
                [f"left out: {'; '.join(self.left_out)}"] if self.left_out else [])


def typed_value(value) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """GGUF value type for a plain Python value (ints are u32, floats f32, as llama.cpp writes;
    a list of one such type is an array of it, its ints i32 as gguf-py types an array's items)."""
    if isinstance(value, list) and value:
        items = {GGUFValueType.INT32 if t == GGUFValueType.UINT32 else t for t in (typed_value(v)[1] for v in value)}
        if len(items) == 1 and GGUFValueType.ARRAY not in items:
            return value, GGUFValueType.ARRAY, items.pop()
    if isinstance(value, bool):
        return value, GGUFValueType.BOOL, None
    if isinstance(value, int):
        return value, GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32, None
    if isinstance(value, float):
        return value, GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return value, GGUFValueType.STRING, None
    raise TypeError(f"no GGUF type for {value!r}")


def write_gguf(path: Path, arch: str, metadata: list[tuple[str, object, GGUFValueType, GGUFValueType | None]],
               tensors: list[PlannedTensor], progress: bool = True, split_max_size: int = 0,
               inputs: list[Path] = ()) -> Summary:
    """metadata: (key, value, type, array item type) in file order; general.architecture is added.
    split_max_size: above it, the tensors go into parts of at most that many bytes each (a tensor
    larger alone has a part to itself), named and keyed as llama-gguf-split writes them; a model
    that fits is written whole. Written atomically (safe_files.atomic_outputs): a failure leaves
    no output; nor may a part replace one of the inputs (the files read)."""
    start = time.perf_counter()
    path = Path(path)
    if sum(t.nbytes for t in tensors) <= split_max_size:
        split_max_size = 0  # (gguf's writer would warn that it does not split)
    for p in inputs if split_max_size else ():
        parsed = parse_part_name(Path(p).name)
        if parsed and parsed[0] == path.stem and same_file(Path(p).parent, path.parent):
            raise OutputError(f"the parts of {path.name} could replace {p}, which this command reads: write the "
                              f"output under another name")
    with atomic_outputs(path, inputs) as tmp:
        w = GGUFWriter(str(tmp), arch, split_max_size=split_max_size)
        for key, value, vtype, sub in metadata:
            w.add_key_value(key, value, vtype, sub)
        for t in tensors:
            block, size = GGML_QUANT_SIZES[t.type]
            byte_shape = tuple(reversed(t.shape[1:])) + (t.shape[0] // block * size,)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        quantized = [t for t in tensors if t.type in BLOCK_TYPES and not t.quantized]
        if progress and not (quantizers_compiled({t.type for t in quantized if t.imatrix is None})
                             and quantizers_compiled({t.type for t in quantized if t.imatrix is not None}, weighted=True)):
            print("compiling the Numba quantizers (first conversion only; cached for later runs)...", file=sys.stderr)
        for t in progress_bar(tensors, desc="quantizing", unit="tensor", disable=not progress):
            if t.quantized:
                w.write_tensor_data(np.asarray(t.load(), dtype=np.uint8).reshape(-1))
                continue
            data = np.asarray(t.load(), dtype=np.float32)
            if not np.isfinite(data).all():
                raise ConversionError(f"tensor {t.name} contains NaN or Inf values")
            raw = quantize(data.reshape(-1, t.shape[0]), t.type, t.imatrix)
            w.write_tensor_data(raw.reshape(-1))
        w.close()
        parts = [path.with_name(p.name) for p in w.format_shard_names(tmp)]
    n_params = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    return Summary(path, time.perf_counter() - start, n_params, sum(t.nbytes for t in tensors),
                   Counter(t.type.name for t in tensors), parts)
