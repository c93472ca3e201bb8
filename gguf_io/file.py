"""A GGUF file mapped into memory: typed metadata, the tensor table, zero-copy tensor views."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from .errors import GGUFError
from .parser import Header, MetadataValue, TensorInfo, parse_header


class GGUFFile:
    """Opens `path` read-only with mmap; tensor data is never copied, only viewed."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size == 0:
                    raise GGUFError(f"{self.path}: file is empty")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"cannot open {self.path}: {e.strerror or e}") from None
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            header: Header = parse_header(self._map, self.size)
        except GGUFError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        self.version = header.version
        self.metadata: dict[str, MetadataValue] = header.metadata
        self.tensors: dict[str, TensorInfo] = header.tensors
        self.data_offset = header.data_offset
        self.alignment = header.alignment

    def get(self, key: str, default=None):
        """The plain value of a metadata key, or `default` when the key is absent."""
        field = self.metadata.get(key)
        return default if field is None else field.value

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: general.architecture is missing or not a string")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw blocks as a read-only uint8 array of shape (rows, bytes per row)."""
        t = self.tensors[name]
        return self._bytes[t.offset:t.offset + t.nbytes].reshape(t.n_rows, t.row_bytes)

    def release(self, name: str) -> None:
        """Tell the system the tensor's pages of the mapping will not be read again (a backend
        copied what it needs): they leave this process's memory and stay in the page cache."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        first, last = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def bits_per_weight(self) -> float:
        n = sum(t.n_elements for t in self.tensors.values())
        return 8.0 * sum(t.nbytes for t in self.tensors.values()) / max(n, 1)

