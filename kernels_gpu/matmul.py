"""Quantized weight matrices resident on a torch device, and their products with activations.

A matrix is its GGUF rows uploaded as bytes, (N, bytes per row) uint8: a 4-bit matrix occupies
its ~4.5 bits per weight on the device. Products never dequantize the whole matrix:

- one token (decode), compiled (CUDA): `dequantize(rows) * x` summed along each row, a function
  that torch.compile turns into one Triton reduction that reads the quantized bytes and keeps
  the dequantized weights in registers.
- more tokens (prefill), or any product run eagerly (CPU): tiles of rows are dequantized to
  float32 and multiplied by the device's BLAS, so a tile of weights serves every token at once;
  only one tile exists at a time.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from .dequant import DEQUANTIZE

# Floats in one dequantized tile (16 MiB of float32): bounds the memory a product borrows.
TILE_ELEMENTS = 1 << 22


class QuantMatrix:
    def __init__(self, qtype, raw: torch.Tensor, k: int, experts: int = 1):
        """experts: a mixture's expert tensor, `experts` matrices of equal rows one after the other."""
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if k % block or raw.shape[1] != k // block * block_bytes:
            raise ValueError(f"{qtype.name} rows of {k} weights take {k // block * block_bytes} bytes, "
                             f"got {raw.shape[1]}")
        if experts < 1 or raw.shape[0] % experts:
            raise ValueError(f"{raw.shape[0]} rows do not divide into {experts} experts")
        self.qtype, self.raw, self.k, self.experts = qtype, raw, k, experts
        self.n = raw.shape[0]
        self.tile_rows = max(1, TILE_ELEMENTS // k)
        self._views = {}

    def expert(self, e: int) -> QuantMatrix:
        """Expert e's rows, as a matrix of their own (a view of the same bytes)."""
        if e not in self._views:
            n = self.n // self.experts
            self._views[e] = QuantMatrix(self.qtype, self.raw[e * n:(e + 1) * n], self.k)
        return self._views[e]

    def tiles(self):
        for start in range(0, self.n, self.tile_rows):
            yield start, self.raw[start:start + self.tile_rows]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the matrix as float32 (embedding lookups)."""
        return DEQUANTIZE[self.qtype](self.raw[ids])


def row_dots(dequantize, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x (k,) against every row of raw: (N,). The function torch.compile fuses on CUDA."""
    return (dequantize(raw) * x).sum(dim=-1)


def expert_row_dots(dequantize, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x[s] (k,) against every row of raw[s] (the rows of slot s's expert): (slots, rows)."""
    slots, rows, _ = raw.shape
    return (dequantize(raw.reshape(slots * rows, -1)).view(slots, rows, -1) * x[:, None, :]).sum(dim=-1)


class Products:
    """Matrix products on one device; `compiled` fuses dequantization into the decode products."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self._row_dots = {}
        if compiled:
            # Every type's row-dot function shares one code object, whose compiled variants (a
            # static one per first shape, then a dynamic one) count against one limit.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def _dots(self, qtype, dots=row_dots):
        fn = self._row_dots.get((qtype, dots))
        if fn is None:
            dequantize = DEQUANTIZE[qtype]

            def fn(raw, x):
                return dots(dequantize, raw, x)
            if self.compiled:
                # fullgraph: a graph break would split the fusion and materialize the weights.
                # Dynamo tells the types apart by the dequantizer's code (a guard on a type
                # argument was missed: Q4_K reused Q4_0's graph of the same byte shape).
                fn = torch.compile(fn, fullgraph=True)
            self._row_dots[qtype, dots] = fn
        return fn

    def matmul(self, w: QuantMatrix, x: torch.Tensor) -> torch.Tensor:
        """x (T, k) @ W.T -> (T, N) float32."""
        if x.shape[0] == 1 and self.compiled:
            return self._dots(w.qtype)(w.raw, x[0])[None]
        # eagerly, a dequantized tile times x is the same arithmetic as the row dots, and faster
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32, device=x.device)
        for start, tile in w.tiles():
            out[:, start:start + tile.shape[0]] = x @ DEQUANTIZE[w.qtype](tile).T
        return out


    def expert_matmul(self, w: QuantMatrix, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Slot s = t * k + j (token t's j-th expert, ids (T, k)) times that expert: (T * k, rows
        per expert), each slot reading its token's row of x, or its own where x has a row per slot.
        One token's slots (decode) gather their experts' bytes and nothing else, with no value
        read back to the host (a CUDA graph captures them); more tokens go expert by expert."""
        flat = ids.reshape(-1)
        x = x.repeat_interleave(flat.numel() // x.shape[0], dim=0) if x.shape[0] != flat.numel() else x
        n = w.n // w.experts
        if ids.shape[0] == 1:
            raw = w.raw.view(w.experts, n, -1)[flat]
            if self.compiled:
                return self._dots(w.qtype, expert_row_dots)(raw, x)
            return expert_row_dots(DEQUANTIZE[w.qtype], raw, x)
        out = torch.empty((flat.numel(), n), dtype=torch.float32, device=x.device)
        order = torch.argsort(flat, stable=True)
        ends = torch.bincount(flat, minlength=w.experts).cumsum(0).tolist()
        for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            if end > start:
                slots = order[start:end]
                out[slots] = self.matmul(w.expert(e), x[slots])
        return out


def upload(qtype, raw: np.ndarray, k: int, device, experts: int = 1) -> QuantMatrix:
    """A matrix from raw GGUF rows (a read-only view of the mapped file) onto the device, as bytes.
    On the CPU the tensor shares the mapping; nothing ever writes to it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return QuantMatrix(qtype, torch.from_numpy(raw).to(device), k, experts)
