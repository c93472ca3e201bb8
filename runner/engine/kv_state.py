"""A KV cache's whole state outside the cache: a snapshot in memory, and the same on disk.

Keys and values are kept as the backends' export_kv gives them, one layout on every backend and
CPU, so a state saved on one machine restores on another, into a cache of the same shape (the
same model, context, ring and element type). On disk it is an .npz of plain arrays (read without
pickle) with a JSON header; every array is checked against the cache before it is read, and
again before any is written in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gguf_io.safe_files import atomic_output

from .npz_files import NpzError, expect, read_npz

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
    recurrent: dict = field(default_factory=dict)  # a hybrid's recurrent layers' state arrays, by name

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
        arrays |= {f"recurrent_{name}": a for name, a in self.recurrent.items()}
        with atomic_output(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: Path, cache) -> KVState:
        """A state saved for a cache like `cache`: its header first, then every array, each checked
        against what the cache holds before its data is read (KVStateError otherwise)."""
        try:
            header = read_npz(path, _check_header, names={"header"})["header"]
            header = json.loads(str(header))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ValueError
            state = cls(shape=header["shape"], used=_count(header["used"]), pinned=_count(header["pinned"]),
                        evicted=_count(header["evicted"]), positions=[], keys=[], values=[], pinned_keys={},
                        pinned_values={}, rotated_to={int(i): _count(r) for i, r in header["rotated_to"].items()},
                        note=header.get("note", {}))
            if not isinstance(state.note, dict):
                raise ValueError
        except NpzError as e:
            raise KVStateError(f"{path} is not a KV cache state saved by ggrun: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise KVStateError(f"{path} is not a KV cache state saved by ggrun") from None
        _check_counts(state, cache)
        expected = expected_arrays(state, cache)

        def check(name, dtype, shape):
            if name not in expected:
                raise NpzError(f"it holds an array {name!r} that a state of this cache does not")
            expect(name, dtype, shape, *expected[name])
        try:
            arrays = read_npz(path, check, names=set(expected))
        except NpzError as e:
            raise KVStateError(f"{path} does not fit this model's KV cache: {e}") from None
        if set(arrays) != set(expected):
            raise KVStateError(f"{path} lacks the saved KV state's {min(set(expected) - set(arrays))}")
        state.positions = [arrays[f"positions_{j}"] for j in range(len(cache.kind_list))]
        state.keys = [arrays[f"keys_{i}"] for i in range(len(cache.keys))]
        state.values = [arrays[f"values_{i}"] for i in range(len(cache.keys))]
        state.pinned_keys = {i: arrays[f"pinned_keys_{i}"] for i in state.rotated_to}
        state.pinned_values = {i: arrays[f"pinned_values_{i}"] for i in state.rotated_to}
        state.recurrent = {name.removeprefix("recurrent_"): a for name, a in arrays.items()
                           if name.startswith("recurrent_")}
        check_fits(state, cache)
        return state


MAX_HEADER_CHARACTERS = 64 << 20  # (the note holds the conversation's text)


def _check_header(name, dtype, shape) -> None:
    if np.dtype(dtype).kind != "U" or shape != () or np.dtype(dtype).itemsize > 4 * MAX_HEADER_CHARACTERS:
        raise NpzError("its header is not one string of JSON")


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    return value


def _check_counts(state: KVState, cache) -> None:
    """The state's shape and counts against the cache's, before any array is read."""
    shape = cache.shape()
    if state.shape != shape:
        diff = ", ".join(f"{k} {state.shape.get(k)!r} (here {v!r})" for k, v in shape.items()
                         if state.shape.get(k) != v) if isinstance(state.shape, dict) else "no shape"
        raise KVStateError(f"the saved KV state is for another cache: {diff}")
    if not 0 <= state.pinned <= state.used or state.evicted < 0:
        raise KVStateError(f"the saved KV state holds inconsistent counts (pinned {state.pinned}, "
                           f"used {state.used}, evicted {state.evicted})")
    global_layers = {i for i, w in enumerate(cache.windowed) if not w} if state.pinned else set()
    if set(state.rotated_to) != global_layers:
        raise KVStateError("the saved KV state's pinned keys do not match its layers")


def expected_arrays(state: KVState, cache) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every array a state of `used` and `pinned` tokens for `cache` holds, by name: dtype and shape."""
    arrays = {f"positions_{j}": (np.dtype(np.int32), (kind[1],)) for j, kind in enumerate(cache.kind_list)}
    for i, (keys, values) in enumerate(zip(cache.keys, cache.values)):
        n = min(state.used, cache.capacity[i])
        empty_keys, empty_values = cache.backend.export_kv(keys, values, np.arange(0))
        arrays[f"keys_{i}"] = (empty_keys.dtype, (empty_keys.shape[0], n, empty_keys.shape[2]))
        arrays[f"values_{i}"] = (empty_values.dtype, (empty_values.shape[0], n, empty_values.shape[2]))
    for i in state.rotated_to:
        n_kv, key_dim, value_dim = cache.head_shapes[i]
        arrays[f"pinned_keys_{i}"] = (np.dtype(np.float32), (state.pinned, n_kv, key_dim))
        arrays[f"pinned_values_{i}"] = (np.dtype(np.float32), (state.pinned, n_kv, value_dim))
    if cache.recurrent is not None:
        arrays |= {f"recurrent_{name}": expected for name, expected in cache.recurrent.expected().items()}
    return arrays


def check_fits(state: KVState, cache) -> None:
    """Raise KVStateError unless every part of `state` fits `cache` as it would have made it."""
    _check_counts(state, cache)
    given = {f"positions_{j}": a for j, a in enumerate(state.positions)}
    given |= {f"keys_{i}": a for i, a in enumerate(state.keys)} | {f"values_{i}": a for i, a in enumerate(state.values)}
    given |= {f"pinned_keys_{i}": a for i, a in state.pinned_keys.items()}
    given |= {f"pinned_values_{i}": a for i, a in state.pinned_values.items()}
    given |= {f"recurrent_{name}": a for name, a in state.recurrent.items()}
    expected = expected_arrays(state, cache)
    if set(given) != set(expected):
        raise KVStateError("the saved KV state's arrays do not match its layers")
    for name, (dtype, shape) in expected.items():
        try:
            expect(name, given[name].dtype, given[name].shape, dtype, shape)
        except NpzError as e:
            raise KVStateError(f"the saved KV state's {str(e).removeprefix('its ')}") from None
    for j, table in enumerate(state.positions):
        if table.size and not (-1 <= table.min() and table.max() < state.used):
            raise KVStateError(f"the saved KV state's positions_{j} hold positions past its {state.used} tokens")
