"""Which weight types (quantized, or F32/F16/BF16) a kernel is compiled for: only those of the
model it runs.

A kernel that takes any type branches on the type inside (rowdot.switch_on_type), and each
branch is a type's whole decoder: compiled for every type, the products alone would dominate a
first run's compile time. So the products table (matmul.MATRIX) names the types it may hold in
its dtype, as a field `types__Q4_K__Q6_K` that holds nothing: its Numba type differs per set, so
each set is its own compiled (and cached) signature, and the kernels emit branches for those
types alone.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

_PREFIX = "types__"


def tagged_dtype(base: np.dtype, qtypes) -> np.dtype:
    """base with a field naming qtypes."""
    name = _PREFIX + "__".join(t.name for t in sorted(qtypes))
    return np.dtype(base.descr + [(name, np.uint8)])


def tagged_types(array_type) -> tuple:
    """The weight types a Numba array type of a tagged_dtype names."""
    for name in array_type.dtype.fields:
        if name.startswith(_PREFIX):
            return tuple(GGMLQuantizationType[t] for t in name[len(_PREFIX):].split("__") if t)
    raise TypeError(f"{array_type} names no weight types")


class WeightTypes:
    """The weight types of one model's matrices, gathered as they load (all of them before
    its first product, so that its tables share one dtype)."""

    def __init__(self, qtypes=()):
        self._qtypes = set(qtypes)

    def add(self, qtype) -> None:
        self._qtypes.add(qtype)

    def dtype(self, base: np.dtype) -> np.dtype:
        """base tagged with these types."""
        return tagged_dtype(base, self._qtypes)
