"""Reading Hugging Face safetensors checkpoints (single file or sharded), one tensor at a time.

Files are memory-mapped; a tensor is copied only when it is converted to float32, so peak memory
is about one tensor, not the checkpoint. Pickle checkpoints (.bin/.pt) are refused: loading them
can execute code from the file.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from .errors import ConversionError

# (U8: the blocks and scales of an MXFP4 checkpoint, carried through as bytes)
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "U8": np.dtype("u1")}
MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = path.stat().st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise ConversionError(f"cannot read {path.name}: {e.strerror or e}") from None
        if size < 8:
            raise ConversionError(f"{path.name}: not a safetensors file (too short)")
        (n,) = struct.unpack_from("<Q", self._map, 0)
        if n > min(MAX_HEADER, size - 8):
            raise ConversionError(f"{path.name}: corrupt safetensors header (claims {n} bytes)")
        try:
            header = json.loads(bytes(self._map[8:8 + n]))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConversionError(f"{path.name}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{path.name}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
                if any(d < 0 for d in shape) or not isinstance(begin, int) or not isinstance(end, int):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise ConversionError(f"{path.name}: corrupt entry for tensor {name!r}") from None
            if dtype not in _DTYPES:
                raise ConversionError(f"{path.name}: tensor {name!r} has dtype {dtype}; "
                                      "F32, F16, BF16 and U8 (MXFP4 blocks) are supported")
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * _DTYPES[dtype].itemsize or begin < 0 or 8 + n + end > size:
                raise ConversionError(f"{path.name}: tensor {name!r} has inconsistent or out-of-file data offsets")
            self.entries[name] = (dtype, shape, 8 + n + begin, count)

    def float32(self, name: str) -> np.ndarray:
        dtype, shape, offset, count = self.entries[name]
        if dtype == "U8":
            raise ConversionError(f"{self.path.name}: tensor {name!r} holds bytes (U8), not weights")
        raw = np.frombuffer(self._map, _DTYPES[dtype], count, offset)
        if dtype == "BF16":
            out = (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        else:
            out = raw.astype(np.float32).reshape(shape)
        del raw
        # The copy is all we need: let the kernel drop the mapped pages so resident memory stays
        # about one tensor, not the whole checkpoint.
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + count * _DTYPES[dtype].itemsize - start)
        return out

    def bytes(self, name: str) -> np.ndarray:
        """A U8 tensor's bytes (a copy)."""
        dtype, shape, offset, count = self.entries[name]
        if dtype != "U8":
            raise ConversionError(f"{self.path.name}: tensor {name!r} is {dtype}, not bytes (U8)")
        return np.frombuffer(self._map, np.uint8, count, offset).reshape(shape).copy()


class Checkpoint:
    """All tensors of a model folder: name -> file, in llama.cpp's converter order."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shard_names = sorted(set(weight_map.values()))
                if not all(isinstance(s, str) for s in shard_names):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                raise ConversionError(f"{index.name} is not a valid safetensors index") from None
            missing = [s for s in shard_names if not (folder / s).exists()]
            if missing:
                raise ConversionError(f"missing checkpoint shard {missing[0]} (listed in {index.name})")
            shards = [folder / s for s in shard_names]
        else:
            shards = sorted(folder.glob("*.safetensors"))
        if not shards:
            pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            if pickles:
                raise ConversionError(f"{pickles[0]} is a pickle checkpoint, which can run code when loaded; "
                                      "convert it to safetensors first")
            raise ConversionError(f"no .safetensors files in {folder}")
        self.files = [SafetensorsFile(p) for p in shards]
        self.location: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in sorted(f.entries):
                self.location[name] = f
        if index.exists():
            for name, shard in weight_map.items():
                if name not in self.location:
                    raise ConversionError(f"tensor {name!r} listed in {index.name} is missing from {shard}")

    def names(self) -> list[str]:
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.location[name].entries[name][1]

    def float32(self, name: str) -> np.ndarray:
        return self.location[name].float32(name)

    def bytes(self, name: str) -> np.ndarray:
        return self.location[name].bytes(name)
