"""Prefill's weight products on Intel AMX, the tile matrix units of Sapphire Rapids and later.

BLAS's float32 products bound the precise path's prefill. An AMX instruction
(tdpbf16ps) multiplies a 16 x 32 by a 32 x 16 matrix of bfloat16 into float32 accumulators.
bfloat16 keeps 8 bits of a value, far from [1/7]'s bound of 1e-5 * max|w| * sum|x| per product,
so every value is split in two: hi, its nearest bfloat16, and lo, the nearest to what is left.
x.w is then xh.wh + xh.wl + xl.wh (xl.wl is below 2^-16 of it), about 16 bits of each operand
for three tile products, still faster than BLAS per core. A tile load costs about as much as a
tile product and the two do not overlap, so the 2 x 2 blocks of outputs below load 10 tiles per
12 products.

Operands are packed so that every tile the instruction loads is one contiguous KiB (rows 4 KiB
apart would all fall in one L1 set), as bfloat16 bits (uint16):
- activations (T, K), once per product, rows padded to 32: (T/16, K/32, 16 rows, 32 columns);
- weight rows, dequantized per tile of rows, padded to 32: (N/16, K/2, 16 rows x 2 columns),
  two consecutive columns of a row side by side, the order the instruction takes its second
  operand in.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import threading

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .cpu_features import compiles_for_host
from .ir import (F32, I8, I16, I32, I64, LANES, array_data, array_shape, array_strides, const_vector, load_vector,
                 offset, vector)
from .rowdot import row_dequantize
from .threads import in_parallel

# Tiles 0-3 accumulate a 32 x 32 block of outputs; 4-5 hold activation tiles, 6-7 weight tiles.
_ACCUMULATORS, _A_TILES, _B_TILES = (0, 1, 2, 3), (4, 5), (6, 7)
_TILE_BYTES = 1024  # 16 rows of 64 bytes, every tile


def _tile_config() -> ir.Constant:
    """ldtilecfg's 64 bytes: palette 1, tiles 0-7 of 16 rows of 64 bytes."""
    config = bytearray(64)
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t] = 64
        config[48 + t] = 16
    return ir.Constant(ir.ArrayType(I8, 64), bytearray(config))


def call(b, name, *args):
    """Call LLVM's AMX intrinsic llvm.x86.<name> (tile numbers are i8 immediates)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]),
                                        f"llvm.x86.{name}")
    b.call(fn, list(args))


def tile(t):
    return ir.Constant(I8, t)


@intrinsic
def _tile_products(typingctx, a_hi, a_lo, b_hi, b_lo, c):
    """c = A @ B.T for packed activations A (hi and lo parts, (M/16, K/32, 16, 32) bfloat16 bits)
    and packed weights B ((N/16, K/2, 32)), c (M, N) float32; M and N multiples of 32."""
    def codegen(context, b, signature, args):
        a_type, *_, c_type = signature.args
        a_hi_p, a_lo_p, b_hi_p, b_lo_p, c_p = (array_data(context, b, t, v) for t, v in zip(signature.args, args))
        m_tiles, k_steps = array_shape(context, b, a_type, args[0])[:2]
        n_cols = array_shape(context, b, c_type, args[4])[1]
        const = lambda v: ir.Constant(I64, v)  # noqa: E731
        config = cgutils.global_constant(b.module, "ggrun.amx.config", _tile_config())
        call(b, "ldtilecfg", b.bitcast(config, I8.as_pointer()))
        row_bytes, c_row_bytes = const(64), b.mul(n_cols, const(4))
        a_block = b.mul(k_steps, const(_TILE_BYTES))  # one 16-row block of A, all of K
        b_block = a_block  # likewise 16 rows of B
        # 32 columns of outputs at a time, all rows: their weights stay in L2 while the
        # activations stream past them.
        with cgutils.for_range(b, b.udiv(n_cols, const(32))) as cols:
            b_at = [b.mul(b.add(b.mul(cols.index, const(2)), const(j)), b_block) for j in (0, 1)]
            with cgutils.for_range(b, b.udiv(m_tiles, const(2))) as rows:
                a_at = [b.mul(b.add(b.mul(rows.index, const(2)), const(i)), a_block) for i in (0, 1)]
                for t in _ACCUMULATORS:
                    call(b, "tilezero", tile(t))
                with cgutils.for_range(b, k_steps) as step:
                    at = b.mul(step.index, const(_TILE_BYTES))

                    def load(tiles, base, starts):
                        for t, start in zip(tiles, starts):
                            call(b, "tileloadd64", tile(t), offset(b, base, b.add(start, at)), row_bytes)

                    def multiply():
                        for i, a_tile in enumerate(_A_TILES):
                            for j, b_tile in enumerate(_B_TILES):
                                call(b, "tdpbf16ps", tile(_ACCUMULATORS[2 * i + j]), tile(a_tile), tile(b_tile))
                    load(_A_TILES, a_hi_p, a_at)
                    load(_B_TILES, b_hi_p, b_at)
                    multiply()  # xh.wh
                    load(_B_TILES, b_lo_p, b_at)
                    multiply()  # xh.wl
                    load(_A_TILES, a_lo_p, a_at)
                    load(_B_TILES, b_hi_p, b_at)
                    multiply()  # xl.wh
                first = offset(b, c_p, b.add(b.mul(b.mul(rows.index, const(32)), c_row_bytes),
                                             b.mul(cols.index, const(32 * 4))))
                for i in (0, 1):
                    for j in (0, 1):
                        at = offset(b, first, b.add(b.mul(const(16 * i), c_row_bytes), const(64 * j)))
                        call(b, "tilestored64", tile(_ACCUMULATORS[2 * i + j]), at, c_row_bytes)
        call(b, "tilerelease")
        return context.get_dummy_value()
    return types.none(a_hi, a_lo, b_hi, b_lo, c), codegen


def _round_to_bf16(b, bits):
    """<16 x i32> float32 bits -> the nearest bfloat16 values (ties to even), as float32 bits."""
    half = lambda v: ir.Constant(bits.type, [v] * LANES)  # noqa: E731
    odd = b.and_(b.lshr(bits, half(16)), half(1))
    return b.and_(b.add(b.add(bits, half(0x7FFF)), odd), half(0xFFFF0000))


@intrinsic
def _split_row(typingctx, src, dst_hi, dst_lo, dst_at, chunk_stride):
    """Split the float32 row src (K values, K a multiple of 32) into bfloat16 hi = nearest(v) and
    lo = nearest(v - hi): values 32c ... 32c + 31 go to dst[dst_at + c * chunk_stride ...] of
    the uint16 arrays dst_hi and dst_lo. Callers check the bounds."""
    def codegen(context, b, signature, args):
        src_t, hi_t, lo_t, _, _ = signature.args
        src_p = array_data(context, b, src_t, args[0])
        hi_p, lo_p = array_data(context, b, hi_t, args[1]), array_data(context, b, lo_t, args[2])
        dst_at, chunk_stride = args[3], args[4]
        k = array_shape(context, b, src_t, args[0])[0]
        with cgutils.for_range(b, b.udiv(k, ir.Constant(I64, LANES))) as loop:
            v = load_vector(b, src_p, b.mul(loop.index, ir.Constant(I64, LANES)), F32)
            chunk, half = b.udiv(loop.index, ir.Constant(I64, 2)), b.urem(loop.index, ir.Constant(I64, 2))
            at = b.add(b.add(dst_at, b.mul(chunk, chunk_stride)), b.mul(half, ir.Constant(I64, LANES)))
            hi = _round_to_bf16(b, b.bitcast(v, vector(I32)))
            lo = _round_to_bf16(b, b.bitcast(b.fsub(v, b.bitcast(hi, vector(F32))), vector(I32)))
            for bits, ptr in ((hi, hi_p), (lo, lo_p)):
                halves = b.trunc(b.lshr(bits, ir.Constant(vector(I32), [16] * LANES)), vector(I16))
                target = b.gep(b.bitcast(ptr, I16.as_pointer()), [at])
                b.store(halves, b.bitcast(target, vector(I16).as_pointer()), align=2)
        return context.get_dummy_value()
    return types.none(src, dst_hi, dst_lo, dst_at, chunk_stride), codegen


def _transpose_masks():
    """Shuffle masks that transpose 16 rows of 16 lanes in four stages: stage b exchanges bit b of
    the row and lane numbers between rows r and r + b (r without bit b)."""
    stages = []
    for bit in (8, 4, 2, 1):
        low = [c if not c & bit else LANES + c - bit for c in range(LANES)]
        high = [c + bit if not c & bit else LANES + c for c in range(LANES)]
        stages.append((bit, low, high))
    return stages


@intrinsic
def _transpose_pairs(typingctx, src, dst):
    """dst[p * 16 + r] = src[r, p] for src (16, P) 32-bit values, P a multiple of 16: a weight
    tile's column pairs, row by row, into the order tdpbf16ps takes. Blocks of 16 x 16 go
    through registers; callers check the bounds."""
    def codegen(context, b, signature, args):
        src_t, dst_t = signature.args
        src_p, dst_p = array_data(context, b, src_t, args[0]), array_data(context, b, dst_t, args[1])
        row_bytes = array_strides(context, b, src_t, args[0])[0]
        n_blocks = b.udiv(b.udiv(row_bytes, ir.Constant(I64, 4)), ir.Constant(I64, LANES))
        with cgutils.for_range(b, n_blocks) as block:
            first = b.mul(block.index, ir.Constant(I64, 4 * LANES))
            rows = [b.load(b.bitcast(offset(b, src_p, b.add(b.mul(ir.Constant(I64, r), row_bytes), first)),
                                     vector(I32).as_pointer()), align=4) for r in range(LANES)]
            for bit, low, high in _transpose_masks():
                for r in range(LANES):
                    if not r & bit:
                        a, c = rows[r], rows[r + bit]
                        rows[r] = b.shuffle_vector(a, c, const_vector(I32, low))
                        rows[r + bit] = b.shuffle_vector(a, c, const_vector(I32, high))
            out = offset(b, dst_p, b.mul(block.index, ir.Constant(I64, 4 * LANES * LANES)))
            for r, row in enumerate(rows):
                b.store(row, b.bitcast(offset(b, out, 4 * LANES * r), vector(I32).as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(src, dst), codegen


def _padded(n: int) -> int:
    """Rows of x and of W go into the products in multiples of 32."""
    return (n + 31) // 32 * 32


@njit(cache=True, nogil=True)
def _pack_activations(x, first_group, last_group, a_hi, a_lo):
    """Rows 16 * first_group ... 16 * last_group - 1 of x (T, K) float32 into the hi and lo tiles
    (T padded / 16, K / 32, 16, 32) uint16 of _tile_products' first operand. Padding rows stay
    as they were: they only reach output rows that callers drop."""
    n_rows, k = x.shape
    hi, lo = a_hi.reshape(-1), a_lo.reshape(-1)
    for r in range(16 * first_group, min(16 * last_group, n_rows)):
        # row r, values 32c...: tile (r // 16, c), its row r % 16
        _split_row(x[r], hi, lo, (r // 16 * (k // 32) * 16 + r % 16) * 32, 16 * 32)


@njit(cache=True, nogil=True)
def _rows_product(kinds, qtype, raw, first, a_hi, a_lo, b_hi, b_lo, out):
    """out = x @ W[first:first + n].T for the raw rows W of a quantized matrix, x packed by
    _pack_activations, b_hi and b_lo (n padded / 16, K / 2, 32) room for the packed rows, out
    (rows of x padded, n padded) float32. Callers check the bounds."""
    k = a_hi.shape[1] * 32
    n_rows = min(b_hi.shape[0] * 16, raw.shape[0] - first)
    group = np.empty((16, k), np.float32)
    hi, lo = np.empty((16, k), np.uint16), np.empty((16, k), np.uint16)  # rows of pairs
    for g in range(b_hi.shape[0]):
        for lane in range(min(16, max(0, n_rows - 16 * g))):  # (rows past the last: as they were)
            row_dequantize(kinds, qtype, raw, first + 16 * g + lane, group, lane)
            _split_row(group[lane], hi[lane], lo[lane], 0, 32)
        _transpose_pairs(hi, b_hi[g].reshape(-1))
        _transpose_pairs(lo, b_lo[g].reshape(-1))
    _tile_products(a_hi, a_lo, b_hi, b_lo, out)


# Buffers are kept per thread and reused: fresh memory costs a page fault per 4 KiB when first
# written, which in a virtual machine costs more than packing the activations into it.
_buffers = threading.local()


def scratch(name: str, shape: tuple, dtype) -> np.ndarray:
    """This thread's buffer `name`, as an array of this shape; valid until its next request."""
    n = math.prod(shape)
    buf = getattr(_buffers, name, None)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = np.empty(n, dtype=dtype)
        setattr(_buffers, name, buf)
    return buf[:n].reshape(shape)


def activation_tiles(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) float32, C-contiguous, packed for rows_product on all threads; valid until this
    thread's next call."""
    n_groups = _padded(x.shape[0]) // 16
    shape = (n_groups, x.shape[1] // 32, 16, 32)
    a_hi, a_lo = scratch("a_hi", shape, np.uint16), scratch("a_lo", shape, np.uint16)
    in_parallel(lambda first, last: _pack_activations(x, first, last, a_hi, a_lo), n_groups)
    return a_hi, a_lo


def rows_product(kinds, qtype: int, raw: np.ndarray, first: int, last: int, tiles: tuple) -> np.ndarray:
    """x @ W[first:last].T, (T padded, last - first) float32, for the raw rows W of a quantized
    matrix of qtype (one of those kinds' dtype names: type_sets) and x packed by
    activation_tiles (rows within the matrix: callers check); valid until this thread's next
    call."""
    a_hi, a_lo = tiles
    b_shape = (_padded(last - first) // 16, a_hi.shape[1] * 16, 32)
    out = scratch("out", (a_hi.shape[0] * 16, b_shape[0] * 16), np.float32)
    _rows_product(kinds, qtype, raw, first, a_hi, a_lo, scratch("b_hi", b_shape, np.uint16),
                  scratch("b_lo", b_shape, np.uint16), out)
    return out[:, :last - first]


# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux hands a process the tile registers'
# 8 KiB of state only on request; a tile instruction before it is SIGILL.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def usable() -> bool:
    """Whether prefill's products run on AMX: the CPU has it, Numba compiles for this CPU (not
    for a NUMBA_CPU_NAME or NUMBA_CPU_FEATURES chosen to make caches portable, where LLVM could
    not emit the tile instructions), Linux lets this process use it, and GGRUN_AMX is not 0."""
    if os.environ.get("GGRUN_AMX", "1") == "0" or platform.machine() != "x86_64" or platform.system() != "Linux":
        return False
    features = binding.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-bf16")):
        return False
    if not compiles_for_host():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
