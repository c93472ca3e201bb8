"""Importance matrices as llama.cpp stores them: its GGUF imatrix files (written and read) and the
legacy .dat files of older llama-imatrix builds (read).

A GGUF imatrix holds, per weight matrix NAME, NAME.in_sum2 (the squared activations entering each
input column, summed; one row per expert of a mixture), NAME.counts (the activations summed, per
expert) and NAME.in_sum (the activations themselves summed), all float32, with general.type
"imatrix" and the keys imatrix.datasets, imatrix.chunk_count and imatrix.chunk_size. A .dat file
holds per matrix its values already divided by the count and multiplied by the chunks it saw."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import GGUFError
from .file import GGUFFile
from .safe_files import atomic_output

DATASETS, CHUNK_COUNT, CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
_ALIGNMENT = 32
_F32, _U32, _STRING, _ARRAY = 0, 4, 8, 9  # (GGML's float32 tensor type; GGUF's value types)


@dataclass
class ImatrixEntry:
    sums: np.ndarray                        # (matrices, columns) float32: squared activations summed (.dat: one row)
    counts: np.ndarray                      # (matrices,) int64: the activations each row summed
    activations: np.ndarray | None = None   # (matrices, columns) float32: activations summed (GGUF files)


@dataclass
class Imatrix:
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)  # by weight matrix name
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0     # 0 in a .dat file, which does not say
    legacy: bool = False    # read from a .dat file: sums are per-chunk means times chunk_count, counts chunk_count
    has_metadata: bool = True  # a GGUF file's imatrix.datasets, chunk_count and chunk_size keys all there


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def write_imatrix(path, imatrix: Imatrix) -> None:
    """The GGUF file llama-imatrix writes (without its optional per-tensor statistics), tensors in
    name order; atomic: a failure leaves no output."""
    tensors = []
    for name in sorted(imatrix.entries):
        e = imatrix.entries[name]
        tensors.append((f"{name}.in_sum2", e.sums))
        tensors.append((f"{name}.counts", e.counts.reshape(-1, 1)))
        if e.activations is not None:
            tensors.append((f"{name}.in_sum", e.activations))
    kv = [_string("general.type") + struct.pack("<I", _STRING) + _string("imatrix"),
          _string(DATASETS) + struct.pack("<IIQ", _ARRAY, _STRING, len(imatrix.datasets))
          + b"".join(map(_string, imatrix.datasets)),
          _string(CHUNK_COUNT) + struct.pack("<II", _U32, imatrix.chunk_count),
          _string(CHUNK_SIZE) + struct.pack("<II", _U32, imatrix.chunk_size)]
    infos, data, offset = [], [], 0
    for name, values in tensors:
        values = np.ascontiguousarray(values, dtype="<f4")
        dims = list(reversed(values.shape))
        while len(dims) > 1 and dims[-1] == 1:  # (as GGML counts a tensor's dimensions)
            dims.pop()
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, _F32, offset))
        raw = values.tobytes()
        data.append(raw + bytes(-len(raw) % _ALIGNMENT))
        offset += len(data[-1])
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    with atomic_output(Path(path)) as tmp, open(tmp, "wb") as f:
        f.write(head + bytes(-len(head) % _ALIGNMENT))
        f.writelines(data)


def read_imatrix(path) -> Imatrix:
    """An imatrix file of either format (a GGUF file by its magic, else a .dat file), as llama.cpp's
    loader reads it. GGUFError where it is neither."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        return _read_gguf(path) if magic == b"GGUF" else _read_dat(path)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror or e}") from None


def _read_gguf(path: Path) -> Imatrix:
    f = GGUFFile(path)
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, t in f.tensors.items():
        base, dot, suffix = name.rpartition(".")
        if dot and suffix in ("in_sum2", "counts", "in_sum"):
            if t.type != 0:
                raise GGUFError(f"{path.name}: tensor {name} is not F32")
            parts.setdefault(base, {})[suffix] = f.tensor_bytes(name).view("<f4").reshape(t.n_rows, -1)
    entries = {}
    for name, p in sorted(parts.items()):
        if "in_sum2" not in p or "counts" not in p or "in_sum" in p and p["in_sum"].size != p["in_sum2"].size:
            raise GGUFError(f"{path.name}: mismatched sums and counts for {name}")
        sums = p["in_sum2"].astype(np.float32)
        if sums.size % p["counts"].size:
            raise GGUFError(f"{path.name}: {name}'s {sums.size} sums are not a row per count")
        sums = sums.reshape(p["counts"].size, -1)
        entries[name] = ImatrixEntry(sums, np.rint(p["counts"].reshape(-1)).astype(np.int64),
                                     p["in_sum"].reshape(sums.shape).astype(np.float32) if "in_sum" in p else None)
    if not entries:
        raise GGUFError(f"{path.name}: no imatrix data in the file")
    datasets = f.get(DATASETS, [])
    return Imatrix(entries, [str(d) for d in datasets] if isinstance(datasets, list) else [],
                   int(f.get(CHUNK_COUNT, 0)), int(f.get(CHUNK_SIZE, 0)),
                   has_metadata=all(key in f.metadata for key in (DATASETS, CHUNK_COUNT, CHUNK_SIZE)))


def _read_dat(path: Path) -> Imatrix:
    raw, at = path.read_bytes(), 0

    def take(fmt: str):
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(raw):
            raise GGUFError(f"{path.name}: neither a GGUF imatrix nor a complete .dat imatrix file")
        at += size
        return struct.unpack_from(fmt, raw, at - size)

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise GGUFError(f"{path.name}: no imatrix data in the file")
    entries = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        name = bytes(take(f"<{max(length, 0)}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise GGUFError(f"{path.name}: entry {name!r} has no values")
        sums = np.array(take(f"<{nval}f"), dtype=np.float32).reshape(1, nval)
        entries[name] = ImatrixEntry(sums, np.array([ncall], dtype=np.int64))
    chunk_count, datasets = 0, []
    if at < len(raw):  # (the chunk count and the dataset's name are optional)
        (chunk_count,) = take("<i")
        if at + 4 <= len(raw):
            (length,) = take("<i")
            if 0 < length <= len(raw) - at:
                datasets.append(bytes(take(f"<{length}s")[0]).decode("utf-8", "replace"))
    return Imatrix(entries, datasets, chunk_count, 0, legacy=True)
