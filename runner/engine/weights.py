"""Loading a model's tensors from a GGUF file onto a backend, with shape and type checks. Tensors
are named as gguf's constants name them (MODEL_TENSOR, and the layer for a block's)."""
from __future__ import annotations

import numpy as np
from gguf import MODEL_TENSOR
from gguf.quants import dequantize

from gguf_io import Architecture, GGUFError, GGUFFile, ggml_dims


class WeightLoader:
    def __init__(self, f: GGUFFile, backend, arch: Architecture):
        self.f, self.backend, self.arch = f, backend, arch
        self.read: set[str] = set()  # the tensors the model took (check_all_read)
        # id of each weight matrix the model took -> its tensor's name and its matrices (experts, or 1)
        self.names: dict[int, tuple[str, int]] = {}
        unsupported = sorted({f"{t.type.name} ({name})" for name, t in f.tensors.items()
                              if t.type not in backend.supported_types and t.n_elements > 1})
        if unsupported:
            raise GGUFError(f"{f.path.name}: unsupported tensor type {unsupported[0]}"
                            + (f" and {len(unsupported) - 1} more" if len(unsupported) > 1 else ""))

    def check_all_read(self) -> None:
        """GGUFError naming a tensor the model did not take: a file whose tensors the architecture's
        graph does not all use computes something else (llama.cpp refuses it too)."""
        unread = [name for name in self.f.tensors if name not in self.read]
        if unread:
            raise GGUFError(f"{self.f.path.name}: tensor {unread[0]!r}" + (f" and {len(unread) - 1} more" if len(unread) > 1 else "")
                            + f" not used by ggrun's {self.arch.name} model")

    def has(self, tensor: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> bool:
        return tensor in self.arch.tensors and self.arch.tensor_name(tensor, layer, suffix) in self.f.tensors

    def _info(self, name: str, shape: tuple[int, ...]):
        t = self.f.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.f.path.name}: tensor {name!r} is missing")
        self.read.add(name)
        if ggml_dims(t.shape) != ggml_dims(shape):
            raise GGUFError(f"{self.f.path.name}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def matrix(self, tensor: MODEL_TENSOR, n_in: int, n_out: int, layer: int | None = None):
        """A weight matrix mapping n_in features to n_out (GGML shape [n_in, n_out])."""
        name = self.arch.tensor_name(tensor, layer)
        t = self._info(name, (n_in, n_out))
        return self._named(name, self._loaded(name, self.backend.load_matrix(t.type, self.f.tensor_bytes(name), n_in)))

    def table(self, tensor: MODEL_TENSOR, n_in: int, n_out: int):
        """A matrix that is only looked up by rows (backend.load_table): an untied embedding."""
        name = self.arch.tensor_name(tensor)
        t = self._info(name, (n_in, n_out))
        return self._loaded(name, self.backend.load_table(t.type, self.f.tensor_bytes(name), n_in))

    def experts(self, tensor: MODEL_TENSOR, n_in: int, n_out: int, n_expert: int, layer: int):
        """A mixture's expert matrices, each mapping n_in features to n_out (GGML shape
        [n_in, n_out, n_expert])."""
        name = self.arch.tensor_name(tensor, layer)
        t = self._info(name, (n_in, n_out, n_expert))
        return self._named(name, self._loaded(name, self.backend.load_experts(t.type, self.f.tensor_bytes(name), n_in,
                                                                              n_expert)), n_expert)

    def expert_halves(self, tensor: MODEL_TENSOR, n_in: int, n_out: int, n_expert: int, layer: int) -> tuple:
        """The two halves of a mixture's experts held as one tensor of 2 * n_out rows each (GGML
        shape [n_in, 2 * n_out, n_expert]: ffn_gate_up_exps), loaded as two expert matrices
        (copies of the file's rows: each expert's first n_out rows, then its last). The first alone
        carries the tensor's name: both take one input, which llama.cpp's imatrix counts once."""
        name = self.arch.tensor_name(tensor, layer)
        t = self._info(name, (n_in, 2 * n_out, n_expert))
        rows = self.f.tensor_bytes(name).reshape(n_expert, 2, n_out, -1)
        halves = (np.ascontiguousarray(rows[:, j]).reshape(n_expert * n_out, -1) for j in (0, 1))
        first, second = (self.backend.load_experts(t.type, half, n_in, n_expert) for half in halves)
        return self._named(name, first, n_expert), second

    def _named(self, name: str, m, n_matrices: int = 1):
        self.names[id(m)] = (name, n_matrices)
        return m

    def _loaded(self, name: str, m):
        if not getattr(m, "reads_file", True):  # the backend keeps a copy: the mapped pages can go
            self.f.release(name)
        return m

    def vector(self, tensor: MODEL_TENSOR, n: int, layer: int | None = None, suffix: str = "weight",
               times: float = 1.0):
        """A small vector (norm weight, bias, rope factors), decoded to float32 whatever its type
        (and multiplied by `times`)."""
        return self._decoded(tensor, (n,), layer, suffix, times)

    def _decoded(self, tensor: MODEL_TENSOR, shape: tuple[int, ...], layer: int | None, suffix: str,
                 times: float = 1.0):
        """A small tensor of GGML shape `shape`, decoded to float32 (numpy order) onto the backend."""
        values = self._host_values(tensor, shape, layer, suffix)
        return self.backend.load_vector(values if times == 1.0 else values * np.float32(times))

    def _host_values(self, tensor: MODEL_TENSOR, shape: tuple[int, ...], layer: int | None, suffix: str):
        """A small tensor of GGML shape `shape`, decoded to float32 (numpy order) on the host."""
        name = self.arch.tensor_name(tensor, layer, suffix)
        t = self._info(name, shape)
        return dequantize(self.f.tensor_bytes(name).reshape(-1), t.type).reshape(tuple(reversed(shape)))

    def flat(self, tensor: MODEL_TENSOR, shape: tuple[int, ...], layer: int, suffix: str | None = "weight"):
        """A small tensor of GGML shape `shape` as one float32 vector (Mamba2's A and D, held
        [1, heads], and its norm's weights, held per group)."""
        return self.backend.load_vector(self._host_values(tensor, shape, layer, suffix).reshape(-1))

    def optional_vector(self, tensor: MODEL_TENSOR, n: int, layer: int | None = None, suffix: str = "weight"):
        """vector(...), or None where the file does not have it (as llama.cpp's TENSOR_NOT_REQUIRED)."""
        return self.vector(tensor, n, layer, suffix) if self.has(tensor, layer, suffix) else None

    def optional_per_expert(self, tensor: MODEL_TENSOR, n_expert: int, layer: int, suffix: str):
        """A vector of one value per expert (GGML shape [n_expert]) as a table of n_expert rows of
        one, as backend.expert_rows takes it; None where the file does not have it."""
        if not self.has(tensor, layer, suffix):
            return None
        return self.backend.load_vector(self._host_values(tensor, (n_expert,), layer, suffix).reshape(n_expert, 1))

    def optional_scalar(self, tensor: MODEL_TENSOR, layer: int | None = None) -> float | None:
        """A one-value tensor (Gemma 4's layer output scale) as a host float; None where absent."""
        return float(self._host_values(tensor, (1,), layer, "weight")[0]) if self.has(tensor, layer) else None

    def small_table(self, tensor: MODEL_TENSOR, n: int, rows: int, layer: int, suffix: str = "weight"):
        """A small table of `rows` vectors of n (GGML shape [n, rows]: a mixture's per-expert biases,
        a convolution's kernel per channel) as float32 (rows, n), decoded whatever its type."""
        return self._decoded(tensor, (n, rows), layer, suffix)

    def optional_table(self, tensor: MODEL_TENSOR, n: int, rows: int, layer: int, suffix: str = "bias"):
        """small_table(...), or None where the file does not have it."""
        return self.small_table(tensor, n, rows, layer, suffix) if self.has(tensor, layer, suffix) else None
