"""Two Triton kernels over any block layout of triton_blocks.py: one-token row dots (decode) and
the dequantization of a tile of rows (for prefill's BLAS products).

Row dots: a program takes ROWS rows and walks along them BLOCKS blocks at a time, each block
decoded in registers and multiplied by the matching activations; nothing but the quantized bytes
and x is read. Its shape is tuned per matrix shape on a shape's first run on CUDA (a few
configurations, so the first run's compiles stay short), and fixed where Triton interprets
(TRITON_INTERPRET=1, how the tests run these kernels on the CPU).

A mixture's expert products run the same kernel: row r of slot s reads row r of expert ids[s] and
the activations of slot s, so only the chosen experts' bytes are read, with no copy.
"""
from __future__ import annotations

import os

import torch
from gguf import GGML_QUANT_SIZES

import triton
import triton.language as tl

from .dequant import tables
from .triton_blocks import DECODERS

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _block_products(decode: tl.constexpr, table, row_starts, x_rows, row_ok, first, N_BLOCKS: tl.constexpr,
                    BLOCK_BYTES: tl.constexpr, WEIGHTS: tl.constexpr, BLOCKS: tl.constexpr):
    """Weights times activations of blocks first .. first + BLOCKS of each row, (R, B, P, L)."""
    b = first + tl.arange(0, BLOCKS)
    ok = (row_ok[:, None] & (b < N_BLOCKS)[None, :])[:, :, None, None]
    w, inner = decode((row_starts[:, None] + b[None, :] * BLOCK_BYTES)[:, :, None, None], ok, table)
    at = (b * WEIGHTS)[None, :, None, None] + inner[None, None, :, :]
    return w * tl.load(x_rows + at, mask=ok, other=0.0)


@triton.jit
def _row_dots(raw, x, out, ids, table, n_out, rows_per_x, row_bytes, k, decode: tl.constexpr, N_BLOCKS: tl.constexpr,
              BLOCK_BYTES: tl.constexpr, WEIGHTS: tl.constexpr, GATHER: tl.constexpr,
              ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    # (the row's block count is a compile-time constant: a model has few widths, and Triton's
    # interpreter cannot loop to a bound passed at run time)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_out
    slot = rows // rows_per_x
    if GATHER:  # expert ids[slot]'s row, the slot's own activations
        source = tl.load(ids + slot, mask=row_ok, other=0).to(tl.int64) * rows_per_x + rows % rows_per_x
        x_rows = (x + slot.to(tl.int64) * k)[:, None, None, None]
    else:
        source = rows.to(tl.int64)
        x_rows = x
    row_starts = raw + source * row_bytes
    # Products accumulate element by element across steps and are summed once at the end: a sum
    # over the block grid is a reduction across the program's threads, too dear for every step.
    acc = _block_products(decode, table, row_starts, x_rows, row_ok, 0, N_BLOCKS, BLOCK_BYTES, WEIGHTS, BLOCKS)
    for first in range(BLOCKS, N_BLOCKS, BLOCKS):
        acc += _block_products(decode, table, row_starts, x_rows, row_ok, first, N_BLOCKS, BLOCK_BYTES, WEIGHTS,
                               BLOCKS)
    acc = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    tl.store(out + rows, acc, mask=row_ok)


@triton.jit
def _dequantize(raw, out, table, n_rows, row_bytes, k, n_blocks, decode: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                WEIGHTS: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    ok = ((rows < n_rows)[:, None] & (b < n_blocks)[None, :])[:, :, None, None]
    w, inner = decode((raw + rows[:, None] * row_bytes + b[None, :] * BLOCK_BYTES)[:, :, None, None], ok, table)
    at = rows[:, None, None, None] * k + (b * WEIGHTS)[None, :, None, None] + inner[None, None, :, :]
    tl.store(out + at, w, mask=ok)


def _configs(weights: int):
    """Rows per program × weights per step (every block holds 256 weights or fewer), and warps:
    seven configurations around the shapes that win for Q4_K and Q6_K (512-1024 weights over 1-4
    rows, 4 warps), few enough that the first run's compiles stay short."""
    shapes = [(1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8), (16, 256, 8)]
    return [triton.Config({"ROWS": rows, "BLOCKS": step // weights}, num_warps=warps) for rows, step, warps in shapes]


_tuned = {}


def _table(qtype, raw: torch.Tensor) -> torch.Tensor:
    """The bytes of qtype's grid on raw's device (dequant.tables: copied there when the matrix
    was), or raw itself for the types without one (a pointer the decoder never reads)."""
    return tables(raw.device).get(("bytes", qtype), raw)


def _row_dots_kernel(qtype):
    if INTERPRETED:
        return _row_dots
    if qtype not in _tuned:
        # Timings are kept on disk, so only a shape's first run tunes; BLOCK_BYTES tells the types
        # apart there (the disk key holds the kernel's source, not the decoder it is passed).
        _tuned[qtype] = triton.autotune(_configs(GGML_QUANT_SIZES[qtype][0]), key=["n_out", "k", "BLOCK_BYTES"],
                                        cache_results=True)(_row_dots)
    return _tuned[qtype]


def row_dots(qtype, raw: torch.Tensor, k: int, x: torch.Tensor, ids: torch.Tensor | None = None,
             experts: int = 1) -> torch.Tensor:
    """x (k,) against every row of raw (N, row bytes): (N,). With ids (slots,): raw holds
    `experts` matrices of equal rows, x (slots, k) a row per slot, and the result is
    (slots × rows per expert,), slot by slot, each slot's x against its expert's rows."""
    weights, block_bytes = GGML_QUANT_SIZES[qtype]
    rows_per_x = raw.shape[0] // experts
    n_out = rows_per_x * (1 if ids is None else ids.numel())
    out = torch.empty(n_out, dtype=torch.float32, device=raw.device)
    fixed = {"ROWS": 2, "BLOCKS": 2} if INTERPRETED else {}
    _row_dots_kernel(qtype)[lambda meta: (triton.cdiv(n_out, meta["ROWS"]),)](
        raw, x, out, raw if ids is None else ids, _table(qtype, raw), n_out, rows_per_x, raw.shape[1], k,
        decode=DECODERS[qtype], N_BLOCKS=k // weights, BLOCK_BYTES=block_bytes, WEIGHTS=weights, GATHER=ids is not None, **fixed)
    return out


# a tile program's rows and weights per row (not tuned)
TILE_ROWS, TILE_WEIGHTS = 8, 512


def dequantize(qtype, raw: torch.Tensor, k: int) -> torch.Tensor:
    """Rows raw (N, row bytes) as float32 (N, k)."""
    weights, block_bytes = GGML_QUANT_SIZES[qtype]
    out = torch.empty((raw.shape[0], k), dtype=torch.float32, device=raw.device)
    blocks = max(1, TILE_WEIGHTS // weights)
    grid = (triton.cdiv(raw.shape[0], TILE_ROWS), triton.cdiv(k // weights, blocks))
    _dequantize[grid](raw, out, _table(qtype, raw), raw.shape[0], raw.shape[1], k, k // weights, decode=DECODERS[qtype],
                      BLOCK_BYTES=block_bytes, WEIGHTS=weights, ROWS=TILE_ROWS, BLOCKS=blocks)
    return out
