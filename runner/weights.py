"""Loading a model's tensors from a GGUF file onto a backend, with shape and type checks."""
from __future__ import annotations

from gguf.quants import dequantize

from gguf_io import GGUFError, GGUFFile


class WeightLoader:
    def __init__(self, f: GGUFFile, backend):
        self.f, self.backend = f, backend
        unsupported = sorted({f"{t.type.name} ({name})" for name, t in f.tensors.items()
                              if t.type not in backend.supported_types and t.n_elements > 1})
        if unsupported:
            raise GGUFError(f"{f.path.name}: unsupported tensor type {unsupported[0]}"
                            + (f" and {len(unsupported) - 1} more" if len(unsupported) > 1 else ""))

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def _info(self, name: str, shape: tuple[int, ...]):
        t = self.f.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.f.path.name}: tensor {name!r} is missing")
        if t.shape != shape:
            raise GGUFError(f"{self.f.path.name}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def matrix(self, name: str, n_in: int, n_out: int):
        """A weight matrix mapping n_in features to n_out (GGML shape [n_in, n_out])."""
        t = self._info(name, (n_in, n_out))
        m = self.backend.load_matrix(t.type, self.f.tensor_bytes(name), n_in)
        if not getattr(m, "reads_file", True):  # the backend keeps a copy: the mapped pages can go
            self.f.release(name)
        return m

    def vector(self, name: str, n: int):
        """A small vector (norm weight, bias, rope factors), decoded to float32 whatever its type."""
        t = self._info(name, (n,))
        return self.backend.load_vector(dequantize(self.f.tensor_bytes(name).reshape(-1), t.type))
