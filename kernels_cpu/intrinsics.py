"""Small functions for Numba kernels, written in LLVM IR where Numba's own would not vectorize.

exp (Numba calls libm's, one element at a time) and float16 conversions: Numba has no float16
type, so a float16 KV cache (llama.cpp's default) is held as uint16 bits.
"""
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .ir import (FAST, F32, I8, I16, I32, I64, LANES, array_data, array_shape, array_strides, lanes_below,
                 masked_load, masked_store, offset, prefetch, splat, vector)


# exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 split in two parts for exactness
# (Cody-Waite), exp(r) by its degree-6 Taylor polynomial on |r| <= ln(2)/2: relative error < 3e-7.
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06
_EXP_COEFFS = (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)


@intrinsic
def exp_f32(typingctx, x):
    """exp(x) for float32 x; exactly 0 below -87 (where float32 turns subnormal). Callers compiled
    with fastmath may not pass infinities (LLVM then assumes there are none): mask with -1e30."""
    def codegen(context, b, signature, args):
        c = lambda v: ir.Constant(F32, v)  # noqa: E731
        x = b.select(b.fcmp_ordered(">", args[0], c(88.0)), c(88.0), args[0])
        n = b.call(b.module.declare_intrinsic("llvm.rint", [F32]), [b.fmul(x, c(1.4426950408889634))])
        r = b.fsub(b.fsub(x, b.fmul(n, c(_LN2_HI))), b.fmul(n, c(_LN2_LO)))
        p = c(_EXP_COEFFS[0])
        for k in _EXP_COEFFS[1:]:
            p = b.fadd(b.fmul(p, r), c(k))
        scale = b.bitcast(b.shl(b.add(b.fptosi(n, I32), ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)
        return b.select(b.fcmp_ordered("<", x, c(-87.0)), c(0.0), b.fmul(p, scale))
    return types.float32(x), codegen


# LLVM's float32 max, min and rint (fast-math): unlike Numba's max, min and np.rint, loops over
# them vectorize.
def _llvm_float(b, name, values):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(F32, [F32] * len(values)), f"llvm.{name}.f32")
    return b.call(fn, values, fastmath=("fast",))


@intrinsic
def max_f32(typingctx, x, y):
    return types.float32(x, y), lambda context, b, signature, args: _llvm_float(b, "maxnum", args)


@intrinsic
def min_f32(typingctx, x, y):
    return types.float32(x, y), lambda context, b, signature, args: _llvm_float(b, "minnum", args)


@intrinsic
def round_f32(typingctx, x):
    """x rounded to the nearest integer, ties to even."""
    return types.float32(x), lambda context, b, signature, args: _llvm_float(b, "rint", args)


@intrinsic
def from_f32(typingctx, value, like):
    """value as an element of the array `like`: float16 bits (uint16, rounded to nearest even) or
    float32."""
    if like.dtype == types.uint16:
        return types.uint16(value, like), lambda context, b, sig, args: b.bitcast(
            b.fptrunc(args[0], ir.HalfType()), I16)
    if like.dtype == types.float32:
        return types.float32(value, like), lambda context, b, sig, args: (
            args[0] if args[0].type == F32 else b.fptrunc(args[0], F32))
    return None


@intrinsic
def f16_bits(typingctx, value):
    """float32 value as float16 bits (uint16, rounded to nearest even)."""
    return types.uint16(value), lambda context, b, sig, args: b.bitcast(b.fptrunc(args[0], ir.HalfType()), I16)


@intrinsic
def f16_rounded(typingctx, value):
    """float32 value rounded to the nearest float16 (ties to even), as float32."""
    return types.float32(value), lambda context, b, sig, args: b.fpext(b.fptrunc(args[0], ir.HalfType()), F32)


@intrinsic
def pointer_at(typingctx, address, dtype):
    """An integer address as a typed pointer to `dtype` elements, for numba.carray. How the compiled
    decode step (step_program.py) and the products reach arrays of many shapes and owners through
    one table of integers; whoever hands over an address keeps its array alive and checks the
    shape it is read with."""
    pointer = types.CPointer(dtype.dtype)

    def codegen(context, b, signature, args):
        return b.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(address, dtype), codegen


# cache_product asks for the cache line KV_PREFETCH_BYTES past each vector it loads, into L2:
# during decode the weights stream has evicted the cache since the last step. Both layouts are
# read forwards (tiled keys tile by tile, values row by row). Into L2 and further ahead than decode
# products' hints (ir.PREFETCH_BYTES, into L1): a float16 cache's reads then overlap its
# arithmetic (a q8_0 cache, bound by its arithmetic, gains nothing either way).
KV_PREFETCH_BYTES = 8192
# Values and bytes per block of a q8_0 KV cache (kv_layout.py), whose scales cache_product applies.
QBLOCK, QBLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
# Rows of `a` (queries of one KV head) per pass of cache_product: 4 x 4 accumulators, 4 cache
# vectors and 4 broadcast weights fit AVX-512's 32 registers.
QUERIES_TOGETHER = 4


def rows_tag(n: int) -> np.ndarray:
    """An empty array whose type says n: cache_product's count of a's rows, fixed when it
    compiles (a model's queries per KV head)."""
    return np.empty(0, dtype=np.dtype([(f"rows{n}", np.uint8)]))


def _tagged_rows(tag_type) -> int:
    (name,) = tag_type.dtype.fields
    return int(name[len("rows"):])


@intrinsic
def cache_product(typingctx, cache, kv, row_first, col_first, a, out, rows_of_a):
    """out[g, c] = sum_r a[g, r] * C[kv, row_first + r, col_first + c] for g < len(a),
    r < a.shape[1], c < out.shape[1]: a small matrix product against a block of a KV cache C of
    float32, float16 bits (uint16) or q8_0 (int8 and float16 scales as kv_layout.py lays them out,
    applied here); a and out are C-contiguous float32. C is either the array itself (kv heads,
    rows, columns), contiguous along columns, or, for a 4-d array, tiled by columns: (kv heads,
    columns / LANES, rows, LANES), where col_first must be a multiple of LANES (and, for q8_0,
    the rows whole blocks). len(a) is the count rows_tag gave rows_of_a: each count compiles apart
    (variants for every count up to QUERIES_TOGETHER would dominate a first run's compile time).
    Callers guarantee the bounds. Attention uses it twice: scores are queries times keys (tiled:
    kv heads, dim, slots), outputs are weights times values (kv heads, slots, dim).

    Register-blocked: 64 columns of QUERIES_TOGETHER rows of a in 16-lane accumulators run down all
    rows, each cache vector converted once where it is loaded for all of them (the queries of a
    grouped-query head share their keys and values).
    """
    element = {types.uint16: ir.HalfType(), types.float32: F32, types.int8: I8}.get(cache.dtype)
    if element is None or a.dtype != types.float32 or cache.ndim not in (3, 4):
        return None
    tiled = cache.ndim == 4
    n_group = _tagged_rows(rows_of_a)

    def codegen(context, b, signature, args):
        cache_type, _, _, _, a_type, out_type, _ = signature.args
        cache_v, kv, row_first, col_first, a_v, out_v, _ = args
        strides = array_strides(context, b, cache_type, cache_v)
        if tiled:  # a vector of LANES columns starting at a multiple of LANES is one tile's row
            kv_stride, tile_stride, row_stride, _ = strides
            first_at = b.mul(b.udiv(col_first, ir.Constant(I64, LANES)), tile_stride)
        else:
            kv_stride, row_stride, col_stride = strides
            first_at = b.mul(col_first, col_stride)
        base = offset(b, array_data(context, b, cache_type, cache_v),
                      b.add(b.add(b.mul(kv, kv_stride), b.mul(row_first, row_stride)), first_at))
        n_rows = array_shape(context, b, a_type, a_v)[1]
        n_cols = array_shape(context, b, out_type, out_v)[1]
        a_ptr = b.bitcast(array_data(context, b, a_type, a_v), F32.as_pointer())
        out_ptr = b.bitcast(array_data(context, b, out_type, out_v), F32.as_pointer())
        widen = {F32: lambda v: v, I8: lambda v: b.sitofp(v, vector(F32)),
                 ir.HalfType(): lambda v: b.fpext(v, vector(F32))}[element]
        align = 1 if element == I8 else 2
        # q8_0 (kv_layout.py): `dim` int8 rows (keys) or columns (values), then float16 scales
        qblock = ir.Constant(I64, QBLOCK)
        dim = b.udiv(b.mul(array_shape(context, b, cache_type, cache_v)[2], qblock), ir.Constant(I64, QBLOCK_BYTES))

        def key_scales(r, c):
            """The LANES slots' scales (from c) of the block holding row row_first + r of a key tile."""
            block = b.udiv(b.add(row_first, r), qblock)
            scale_row = b.add(dim, b.add(block, block))  # (two rows of bytes hold a tile's LANES scales)
            at = cache_vector(b.sub(scale_row, row_first), c)
            return b.fpext(b.load(b.bitcast(at, vector(ir.HalfType()).as_pointer()), align=1), vector(F32))

        def value_scale(r, c):
            """Row r's scale of the block holding column col_first + c."""
            block = b.udiv(b.add(col_first, c), qblock)
            at = offset(b, base, b.add(b.mul(r, row_stride), b.sub(b.add(dim, b.add(block, block)), col_first)))
            return b.fpext(b.load(b.bitcast(at, ir.HalfType().as_pointer()), align=1), F32)

        def cache_vector(r, c):
            """Pointer to the LANES columns from c (a multiple of LANES) of row r."""
            row = offset(b, base, b.mul(r, row_stride))
            if tiled:
                at = offset(b, row, b.mul(b.udiv(c, ir.Constant(I64, LANES)), tile_stride))
            else:
                at = b.gep(b.bitcast(row, element.as_pointer()), [c])
            return b.bitcast(at, vector(element, LANES).as_pointer())

        def a_at(g, r):
            return b.load(b.gep(a_ptr, [b.add(b.mul(g, n_rows), r)]))

        def columns(gs, first, width, mask=None):
            """out[g, first : first + width * LANES] for each g of gs, from `width` accumulators
            per g (only the lanes of `mask`, when given): each cache vector is loaded and
            converted once for all of gs."""
            zero = ir.Constant(vector(F32), [0.0] * LANES)
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(width)] for _ in gs]
            for acc in (acc for row in accs for acc in row):
                b.store(zero, acc)
            column_at = [b.add(first, ir.Constant(I64, u * LANES)) for u in range(width)]

            def add_row(r, scales=None):
                values = []
                for u, column in enumerate(column_at):
                    at = cache_vector(r, column)
                    if mask is None:
                        prefetch(b, offset(b, b.bitcast(at, I8.as_pointer()), KV_PREFETCH_BYTES), into_l1=False)
                    value = widen(b.load(at, align=align) if mask is None else masked_load(b, at, mask, align))
                    values.append(value if scales is None else b.fmul(value, scales[u], flags=FAST))
                for g, row_accs in zip(gs, accs):
                    weight = splat(b, a_at(g, r))
                    for value, acc in zip(values, row_accs):
                        b.store(b.fadd(b.fmul(value, weight, flags=FAST), b.load(acc), flags=FAST), acc)

            if element != I8:
                with cgutils.for_range(b, n_rows) as rows:
                    add_row(rows.index)
            elif tiled:  # q8_0 keys: each block of QBLOCK rows scaled by its slots' scales, loaded once
                with cgutils.for_range(b, b.udiv(n_rows, qblock)) as blocks:
                    first_row = b.mul(blocks.index, qblock)
                    scales = [key_scales(first_row, column) for column in column_at]
                    with cgutils.for_range(b, qblock) as rows:
                        add_row(b.add(first_row, rows.index), scales)
            else:  # q8_0 values: each row's columns scaled by that row's scale of their block
                with cgutils.for_range(b, n_rows) as rows:
                    add_row(rows.index, [splat(b, value_scale(rows.index, column)) for column in column_at])
            for g, row_accs in zip(gs, accs):
                for u, acc in enumerate(row_accs):
                    at = b.gep(out_ptr, [b.add(b.add(b.mul(g, n_cols), first), ir.Constant(I64, u * LANES))])
                    at = b.bitcast(at, vector(F32).as_pointer())
                    if mask is None:
                        b.store(b.load(acc), at, align=4)
                    else:
                        masked_store(b, b.load(acc), at, mask, 4)

        def all_columns(gs):
            done = ir.Constant(I64, 0)
            for width in (4, 1):  # 64 columns at a time, then 16
                step = ir.Constant(I64, width * LANES)
                count = b.udiv(b.sub(n_cols, done), step)
                start = done
                with cgutils.for_range(b, count) as blocks:
                    columns(gs, b.add(start, b.mul(blocks.index, step)), width)
                done = b.add(done, b.mul(count, step))
            rest = b.sub(n_cols, done)
            with b.if_then(b.icmp_unsigned(">", rest, ir.Constant(I64, 0))):
                columns(gs, done, 1, lanes_below(b, rest))

        # whole chunks of QUERIES_TOGETHER rows of a, then the rest
        together = QUERIES_TOGETHER
        if n_group >= together:
            with cgutils.for_range(b, ir.Constant(I64, n_group // together)) as chunk:
                all_columns([b.add(b.mul(chunk.index, ir.Constant(I64, together)), ir.Constant(I64, j))
                             for j in range(together)])
        if n_group % together:
            all_columns([ir.Constant(I64, n_group // together * together + j) for j in range(n_group % together)])
        return context.get_dummy_value()
    return types.none(cache, kv, row_first, col_first, a, out, rows_of_a), codegen


@intrinsic
def f32_bits(typingctx, value):
    """float32 value's bits as int32."""
    if value != types.float32:
        return None
    return types.int32(value), lambda context, b, sig, args: b.bitcast(args[0], ir.IntType(32))
