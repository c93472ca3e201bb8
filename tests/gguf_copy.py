"""Copies of GGUF files with some metadata changed, for tests of how files are read."""
from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

from gguf_io import GGUFFile


def rewritten(src, dst, changes: dict):
    """A copy of a GGUF file with some metadata values changed (None: the key left out), tensors
    copied as raw bytes."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), f.architecture)
    for key, mv in f.metadata.items():
        if key != "general.architecture" and changes.get(key, mv.value) is not None:
            value = changes.get(key, mv.value)
            w.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else value, mv.type, mv.item_type)
    for name, t in f.tensors.items():
        w.add_tensor_info(name, tuple(reversed(t.shape[1:])) + (t.row_bytes,), np.dtype(np.uint8), t.nbytes,
                          raw_dtype=t.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in f.tensors:
        w.write_tensor_data(np.ascontiguousarray(f.tensor_bytes(name)).reshape(-1))
    w.close()
    return dst
