"""A GGUF file mapped into memory: typed metadata, the tensor table, zero-copy tensor views."""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
from pathlib import Path

import numpy as np

from .errors import GGUFError
from .parser import Header, MetadataValue, TensorInfo, parse_header, shown
from .split import KEY_COUNT, KEY_NO, KEY_TENSORS, MAX_PARTS, part_paths

_REQUIRED = object()  # (the default of a typed getter whose key must be there)
U32_MAX = 2**32 - 1


class _Part:
    """One file of a model mapped read-only, its header parsed."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size == 0:
                    raise GGUFError(f"{path}: file is empty")
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"cannot open {path}: {e.strerror or e}") from None
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        try:
            self.header: Header = parse_header(self.map, self.size)
        except GGUFError as e:
            raise GGUFError(f"{path.name}: {e}") from None

    def split_value(self, key: str, hi: int) -> int | None:
        """split.no, split.count or split.tensors.count: an integer in 0..hi, or None where absent."""
        field = self.header.metadata.get(key)
        if field is None:
            return None
        if isinstance(field.value, bool) or not isinstance(field.value, int) or not 0 <= field.value <= hi:
            raise GGUFError(f"{self.path.name}: {key} = {_shown_value(field.value)} is not an integer in 0..{hi}")
        return field.value


class GGUFFile:
    """Opens `path` read-only with mmap; tensor data is never copied, only viewed. A part of a split
    model (any part) opens all its parts as one file: the first part's metadata, every part's
    tensors, each part validated and mapped on its own."""

    def __init__(self, path: str | os.PathLike):
        given = _Part(Path(path))
        parts = _split_parts(given)
        first = parts[0]
        self.path = first.path
        self.parts = [p.path for p in parts]
        self.size = sum(p.size for p in parts)
        self._parts = parts
        self.version = first.header.version
        self.metadata: dict[str, MetadataValue] = first.header.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for i, part in enumerate(parts):
            for name, t in part.header.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{part.path.name}: tensor {shown(name)} is also in an earlier part")
                self.tensors[name] = dataclasses.replace(t, part=i) if i else t
        declared = first.split_value(KEY_TENSORS, U32_MAX)
        if len(parts) > 1 and declared != len(self.tensors):
            raise GGUFError(f"{first.path.name}: the parts hold {len(self.tensors)} tensors, but {KEY_TENSORS} "
                            f"says {declared}")

    def get(self, key: str, default=None):
        """The plain value of a metadata key, or `default` when the key is absent."""
        field = self.metadata.get(key)
        return default if field is None else field.value

    # Typed getters: a value of the wrong type or outside its range, or a required key that is
    # missing, is a GGUFError that names the key and the value, before any code computes with it.
    # Where the file has no value, the caller's default is returned as it is.

    def refuse(self, key: str, value, why: str):
        raise GGUFError(f"{self.path.name}: {key} = {_shown_value(value)} {why}")

    def _default(self, key: str, default):
        if default is _REQUIRED:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return default

    def get_int(self, key: str, default=_REQUIRED, lo: int = 0, hi: int = U32_MAX) -> int:
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            self.refuse(key, value, "is not an integer")
        if not lo <= value <= hi:
            self.refuse(key, value, f"is outside {lo}..{hi}")
        return value

    def get_float(self, key: str, default=_REQUIRED, lo: float = -math.inf, hi: float = math.inf,
                  positive: bool = False) -> float:
        """A finite number in lo..hi (and above 0 where positive)."""
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.refuse(key, value, "is not a number")
        if not math.isfinite(value):
            self.refuse(key, value, "is not finite")
        if positive and value <= 0:
            self.refuse(key, value, "must be above 0")
        if not lo <= value <= hi:
            self.refuse(key, value, f"is outside {lo}..{hi}")
        return float(value)

    def get_bool(self, key: str, default=_REQUIRED) -> bool:
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if not isinstance(value, int) or value not in (0, 1):
            self.refuse(key, value, "is not a boolean")
        return bool(value)

    def get_str(self, key: str, default=_REQUIRED) -> str:
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if not isinstance(value, str):
            self.refuse(key, value, "is not a string")
        return value

    def get_strings(self, key: str, default=_REQUIRED) -> list[str]:
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.refuse(key, value, "is not an array of strings")
        return value

    def get_numbers(self, key: str, default=_REQUIRED, size: int | None = None, integer: bool = False) -> np.ndarray:
        """An array of numbers (integers where integer), of `size` values where given."""
        if key not in self.metadata:
            return self._default(key, default)
        value = self.get(key)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in ("iub" if integer else "iubf"):
            self.refuse(key, value, f"is not an array of {'integers' if integer else 'numbers'}")
        if size is not None and value.size != size:
            self.refuse(key, value, f"has {value.size} values, not {size}")
        return value

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: general.architecture is missing or not a string")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw blocks as a read-only uint8 array of shape (rows, bytes per row)."""
        t = self.tensors[name]
        return self._parts[t.part].bytes[t.offset:t.offset + t.nbytes].reshape(t.n_rows, t.row_bytes)

    def release(self, name: str) -> None:
        """Tell the system the tensor's pages of the mapping will not be read again (a backend
        copied what it needs): they leave this process's memory and stay in the page cache."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        first, last = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self._parts[t.part].map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def bits_per_weight(self) -> float:
        n = sum(t.n_elements for t in self.tensors.values())
        return 8.0 * sum(t.nbytes for t in self.tensors.values()) / max(n, 1)

    def file_type_name(self) -> str:
        """The quantization mix the file declares (general.file_type), as llama.cpp names it."""
        from gguf import LlamaFileType
        try:
            return LlamaFileType(self.get("general.file_type")).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ValueError, TypeError):
            return "?"



def _split_parts(given: _Part) -> list[_Part]:
    """The parts of the model that `given` belongs to, in order (just `given` when it is whole)."""
    count = given.split_value(KEY_COUNT, MAX_PARTS) or 1
    if count == 1:
        return [given]
    no = given.split_value(KEY_NO, count - 1)
    if no is None:
        raise GGUFError(f"{given.path.name}: {KEY_COUNT} is {count} but {KEY_NO} is missing")
    parts = []
    for i, path in enumerate(part_paths(given.path, no, count)):
        if i == no:
            parts.append(given)
            continue
        if not path.is_file():
            raise GGUFError(f"{given.path.name} is part {no + 1} of {count}: part {i + 1}, {path}, is missing")
        part = _Part(path)
        if (part.split_value(KEY_NO, MAX_PARTS), part.split_value(KEY_COUNT, MAX_PARTS)) != (i, count):
            raise GGUFError(f"{path.name} is not part {i + 1} of {count} of {given.path.name}'s model "
                            f"(its {KEY_NO} and {KEY_COUNT} say otherwise)")
        parts.append(part)
    totals = {p.path.name: p.split_value(KEY_TENSORS, U32_MAX) for p in parts}
    if len(set(totals.values())) > 1:
        raise GGUFError(f"the parts of {parts[0].path.name} disagree on {KEY_TENSORS}: "
                        + ", ".join(f"{n} {v}" for n, v in totals.items()) + " (parts of different models?)")
    return parts


def _shown_value(value) -> str:
    """A metadata value as an error quotes it: short, whatever its size."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype.name} values"
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    return shown(value) if isinstance(value, str) else repr(value)
