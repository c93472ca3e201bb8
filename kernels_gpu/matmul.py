"""Quantized weight matrices resident on a torch device, and their products with activations.

A matrix is its GGUF rows uploaded as bytes, (N, bytes per row) uint8: a 4-bit matrix occupies
its ~4.5 bits per weight on the device. Products never dequantize the whole matrix:

- one token (decode) on CUDA: quantized types run triton_products' row dots, which decode each
  block in registers; the float types run `dequantize(rows) * x` summed along each row, which
  torch.compile fuses into one reduction.
- more tokens (prefill): tiles of rows are dequantized to float32 (by triton_products on CUDA,
  by dequant.py's torch ops elsewhere) and multiplied by the device's BLAS, so a tile of weights
  serves every token at once; only one tile exists at a time. On CUDA the BLAS multiplies in
  TF32 (float32's range, 10 bits of mantissa: the inputs' precision of llama.cpp's float16 BLAS
  path) unless the backend is precise.

Run eagerly on the CPU (torch-cpu), every product takes the tiles: the tests' reference path.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from .dequant import DEQUANTIZE, tables

# Floats in one dequantized tile: bounds the memory a product borrows; 16 MiB of float32 on the
# CPU, 256 MiB on a GPU, where a whole 7B FFN matrix is one tile and one BLAS product.
TILE_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


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
        self.tile_rows = max(1, TILE_ELEMENTS.get(raw.device.type, TILE_ELEMENTS["cpu"]) // k)
        self._views = {}
        tables(raw.device)  # (the decoders' lookup tables, there before torch.compile traces them)

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
    """Matrix products on one device. `compiled` fuses dequantization into the decode products of
    the float types; `triton` runs triton_products' kernels for the quantized types (on the CPU
    only where Triton interprets, as the tests do)."""

    def __init__(self, compiled: bool, triton: bool = False, tf32: bool = False):
        self.compiled, self.tf32 = compiled, tf32
        self.triton = None
        if triton:
            from . import triton_products
            self.triton = triton_products
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

    def _kernels(self, qtype):
        """triton_products where it runs and has the block layout, else None."""
        return self.triton if self.triton is not None and qtype in self.triton.DECODERS else None

    def _dequantize(self, w: QuantMatrix, tile: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels(w.qtype)
        return DEQUANTIZE[w.qtype](tile) if kernels is None else kernels.dequantize(w.qtype, tile, w.k)

    def matmul(self, w: QuantMatrix, x: torch.Tensor) -> torch.Tensor:
        """x (T, k) @ W.T -> (T, N) float32."""
        if x.shape[0] == 1:
            kernels = self._kernels(w.qtype)
            if kernels is not None:
                return kernels.row_dots(w.qtype, w.raw, w.k, x.reshape(-1).contiguous())[None]
            if self.compiled:
                return self._dots(w.qtype)(w.raw, x[0])[None]
        # eagerly, a dequantized tile times x is the same arithmetic as the row dots, and faster
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32, device=x.device)
        tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, self.tf32
        try:
            for start, tile in w.tiles():
                out[:, start:start + tile.shape[0]] = x @ self._dequantize(w, tile).T
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
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
            kernels = self._kernels(w.qtype)
            if kernels is not None:
                return kernels.row_dots(w.qtype, w.raw, w.k, x.contiguous(), flat, w.experts).view(-1, n)
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
