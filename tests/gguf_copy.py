"""Copies of GGUF files with some metadata changed, for tests of how files are read."""
from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFWriter

from gguf_io import GGUFFile, MetadataValue


def rewritten(src, dst, changes: dict, matrices=None):
    """A copy of a GGUF file with some metadata changed, tensors copied as raw bytes. A change is
    a value (the key keeps its type), a MetadataValue (a value of any type, the key added where
    the file lacks it) or None (the key left out). matrices, where given, replaces each matrix
    (an F32 file's): (name, rows as float32) -> (its type, its raw rows)."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), f.architecture)
    added = {key: mv for key, mv in changes.items() if key not in f.metadata and isinstance(mv, MetadataValue)}
    for key, mv in {**f.metadata, **added}.items():
        change = changes.get(key, mv)
        if key == "general.architecture" or change is None:
            continue
        if not isinstance(change, MetadataValue):
            change = MetadataValue(mv.type, change, mv.item_type)
        value = change.value.tolist() if isinstance(change.value, np.ndarray) else change.value
        w.add_key_value(key, value, change.type, change.item_type)
    tensors = {}
    for name, t in f.tensors.items():
        qtype, raw = t.type, np.ascontiguousarray(f.tensor_bytes(name))
        if matrices is not None and len(t.shape) == 2:
            qtype, rows = matrices(name, raw.view(np.float32))
            raw = np.ascontiguousarray(rows).view(np.uint8)
        tensors[name] = raw
        w.add_tensor_info(name, tuple(reversed(t.shape[1:])) + (raw.shape[-1],), np.dtype(np.uint8), raw.nbytes,
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for raw in tensors.values():
        w.write_tensor_data(raw.reshape(-1))
    w.close()
    return dst


def retyped(src, dst, name: str, new_type: int):
    """A copy of a GGUF file whose tensor `name` claims another type in the tensor table (its
    bytes unchanged): a corrupt file whose blocks still fit, which computes NaN."""
    t = GGUFFile(src).tensors[name]
    entry = (struct.pack("<Q", len(name)) + name.encode() + struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *t.shape)
             + struct.pack("<I", int(t.type)))
    data = bytearray(open(src, "rb").read())
    struct.pack_into("<I", data, data.index(entry) + len(entry) - 4, new_type)
    open(dst, "wb").write(bytes(data))
    return dst
