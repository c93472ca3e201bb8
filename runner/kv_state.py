"""A KV cache's whole state outside the cache: a snapshot in memory, and the same on disk.

Keys and values are kept as the backends' export_kv gives them, one layout on every backend and
CPU, so a state saved on one machine restores on another, into a cache of the same shape (the
same model, context, ring and element type). On disk it is an .npz of plain arrays (read without
pickle) with a JSON header; every array is checked against the cache before any is written in.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "ggrun-kv/1"


class KVStateError(ValueError):
    """A saved state that is not one, or that does not fit the cache."""


@dataclass
class KVState:
    shape: dict                 # KVCache.shape(): what a cache must be to take this state
    used: int                   # tokens added; the next one's position
    pinned: int
    evicted: int
    positions: list             # per kind of layer: the position each slot holds (-1: empty)
    keys: list                  # per layer: export_kv's rows of the slots that may be filled
    values: list
    pinned_keys: dict           # global layer -> the pinned keys as first written (float32)
    pinned_values: dict
    rotated_to: dict            # global layer -> the shift its pinned keys sit at
    note: dict                  # the caller's (what model and conversation the state belongs to)

    def save(self, path: Path) -> None:
        header = {"format": FORMAT, "shape": self.shape, "used": self.used, "pinned": self.pinned,
                  "evicted": self.evicted, "rotated_to": {str(i): r for i, r in self.rotated_to.items()},
                  "note": self.note}
        arrays = {"header": np.array(json.dumps(header))}
        arrays |= {f"positions_{j}": a for j, a in enumerate(self.positions)}
        arrays |= {f"keys_{i}": a for i, a in enumerate(self.keys)}
        arrays |= {f"values_{i}": a for i, a in enumerate(self.values)}
        arrays |= {f"pinned_keys_{i}": a for i, a in self.pinned_keys.items()}
        arrays |= {f"pinned_values_{i}": a for i, a in self.pinned_values.items()}
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: Path) -> KVState:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            header = json.loads(str(arrays.pop("header")))
            if header.get("format") != FORMAT:
                raise ValueError
            layers = header["shape"]["layers"]
            pinned = {int(i) for i in header["rotated_to"]}
            return cls(shape=header["shape"], used=int(header["used"]), pinned=int(header["pinned"]),
                       evicted=int(header["evicted"]),
                       positions=[arrays[f"positions_{j}"] for j in range(len(header["shape"]["kinds"]))],
                       keys=[arrays[f"keys_{i}"] for i in range(layers)],
                       values=[arrays[f"values_{i}"] for i in range(layers)],
                       pinned_keys={i: arrays[f"pinned_keys_{i}"] for i in pinned},
                       pinned_values={i: arrays[f"pinned_values_{i}"] for i in pinned},
                       rotated_to={int(i): int(r) for i, r in header["rotated_to"].items()},
                       note=header.get("note", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile, EOFError):
            raise KVStateError(f"{path} is not a KV cache state saved by ggrun") from None


def check_fits(state: KVState, cache) -> None:
    """Raise KVStateError unless every part of `state` fits `cache` as it would have made it."""
    shape = cache.shape()
    if state.shape != shape:
        diff = ", ".join(f"{k} {state.shape.get(k)!r} (here {v!r})" for k, v in shape.items()
                         if state.shape.get(k) != v)
        raise KVStateError(f"the saved KV state is for another cache: {diff}")
    if not 0 <= state.pinned <= state.used or state.evicted < 0:
        raise KVStateError(f"the saved KV state holds inconsistent counts (pinned {state.pinned}, "
                           f"used {state.used}, evicted {state.evicted})")
    for j, (table, kind) in enumerate(zip(state.positions, cache.kind_list)):
        _check_array(f"positions_{j}", table, np.int32, (kind[1],))
        if table.size and not (-1 <= table.min() and table.max() < state.used):
            raise KVStateError(f"the saved KV state's positions_{j} hold positions past its {state.used} tokens")
    for i, (keys, values) in enumerate(zip(cache.keys, cache.values)):
        n = min(state.used, cache.capacity[i])
        empty_keys, empty_values = cache.backend.export_kv(keys, values, np.arange(0))
        _check_array(f"keys_{i}", state.keys[i], empty_keys.dtype, (empty_keys.shape[0], n, empty_keys.shape[2]))
        _check_array(f"values_{i}", state.values[i], empty_values.dtype,
                     (empty_values.shape[0], n, empty_values.shape[2]))
    global_layers = {i for i, w in enumerate(cache.windowed) if not w} if state.pinned else set()
    if set(state.pinned_keys) != global_layers or set(state.rotated_to) != global_layers:
        raise KVStateError("the saved KV state's pinned keys do not match its layers")
    for i in global_layers:
        n_kv, key_dim, value_dim = cache.head_shapes[i]
        _check_array(f"pinned_keys_{i}", state.pinned_keys[i], np.float32, (state.pinned, n_kv, key_dim))
        _check_array(f"pinned_values_{i}", state.pinned_values[i], np.float32, (state.pinned, n_kv, value_dim))


def _check_array(name, array, dtype, shape) -> None:
    if array.dtype != dtype or array.shape != tuple(shape):
        raise KVStateError(f"the saved KV state's {name} is {array.dtype} {array.shape}, not {np.dtype(dtype)} "
                           f"{tuple(shape)}")
