"""Small functions for Numba kernels, written in LLVM IR where Numba's own would not vectorize.

exp (Numba calls libm's, one element at a time) and float16 conversions: Numba has no float16
type, so a float16 KV cache (llama.cpp's default) is held as uint16 bits.
"""
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
def pointer_at(typingctx, address, dtype):
    """An integer address as a typed pointer to `dtype` elements, for numba.carray. How the compiled
    decode step (step_program.py) and the products reach arrays of many shapes and owners through
    one table of integers; whoever hands over an address keeps its array alive and checks the
    shape it is read with."""
    pointer = types.CPointer(dtype.dtype)

    def codegen(context, b, signature, args):
        return b.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(address, dtype), codegen


# cache_product asks for the cache lines this many bytes past each vector it loads: during decode
# the weights stream has evicted the cache since the last step. Both layouts are read forwards
# (tiled keys tile by tile, values row by row). Attention over 2048 slots of SmolLM2 took ~15%
# less time in a decode step than with no prefetch; 16 KiB ahead measured the same.
PREFETCH_BYTES = 4096
# Rows of `a` (queries of one KV head) per pass of cache_product: 4 x 4 accumulators, 4 cache
# vectors and 4 broadcast weights fit AVX-512's 32 registers.
QUERIES_TOGETHER = 4


@intrinsic
def cache_product(typingctx, cache, kv, row_first, col_first, a, out):
    """out[g, c] = sum_r a[g, r] * C[kv, row_first + r, col_first + c] for g < len(a),
    r < a.shape[1], c < out.shape[1]: a small matrix product against a block of a KV cache C of
    float32 or float16 bits (uint16); a and out are C-contiguous float32. C is either the array
    itself (kv heads, rows, columns), contiguous along columns, or, for a 4-d array, tiled by
    columns: (kv heads, columns / LANES, rows, LANES), where col_first must be a multiple of LANES.
    Callers guarantee the bounds. Attention uses it twice: scores are queries times keys (tiled:
    kv heads, dim, slots), outputs are weights times values (kv heads, slots, dim).

    Register-blocked: 64 columns of QUERIES_TOGETHER rows of a in 16-lane accumulators run down all
    rows, each cache vector converted once where it is loaded for all of them (the queries of a
    grouped-query head share their keys and values).
    """
    element = ir.HalfType() if cache.dtype == types.uint16 else F32
    if cache.dtype not in (types.uint16, types.float32) or a.dtype != types.float32 or cache.ndim not in (3, 4):
        return None
    tiled = cache.ndim == 4

    def codegen(context, b, signature, args):
        cache_type, _, _, _, a_type, out_type = signature.args
        cache_v, kv, row_first, col_first, a_v, out_v = args
        strides = array_strides(context, b, cache_type, cache_v)
        if tiled:  # a vector of LANES columns starting at a multiple of LANES is one tile's row
            kv_stride, tile_stride, row_stride, _ = strides
            first_at = b.mul(b.udiv(col_first, ir.Constant(I64, LANES)), tile_stride)
        else:
            kv_stride, row_stride, col_stride = strides
            first_at = b.mul(col_first, col_stride)
        base = offset(b, array_data(context, b, cache_type, cache_v),
                      b.add(b.add(b.mul(kv, kv_stride), b.mul(row_first, row_stride)), first_at))
        n_group, n_rows = array_shape(context, b, a_type, a_v)
        n_cols = array_shape(context, b, out_type, out_v)[1]
        a_ptr = b.bitcast(array_data(context, b, a_type, a_v), F32.as_pointer())
        out_ptr = b.bitcast(array_data(context, b, out_type, out_v), F32.as_pointer())
        widen = (lambda v: b.fpext(v, vector(F32))) if element != F32 else (lambda v: v)

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
            with cgutils.for_range(b, n_rows) as rows:
                values = []
                for u in range(width):
                    column = b.add(first, ir.Constant(I64, u * LANES))
                    at = cache_vector(rows.index, column)
                    if mask is None:
                        prefetch(b, offset(b, b.bitcast(at, I8.as_pointer()), PREFETCH_BYTES))
                    values.append(widen(b.load(at, align=2) if mask is None else masked_load(b, at, mask, 2)))
                for g, row_accs in zip(gs, accs):
                    weight = splat(b, a_at(g, rows.index))
                    for value, acc in zip(values, row_accs):
                        b.store(b.fadd(b.fmul(value, weight, flags=FAST), b.load(acc), flags=FAST), acc)
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

        # whole chunks of QUERIES_TOGETHER rows of a, then the 1 to QUERIES_TOGETHER - 1 left
        together = ir.Constant(I64, QUERIES_TOGETHER)
        n_together = b.udiv(n_group, together)
        first_left = b.mul(n_together, together)
        with cgutils.for_range(b, n_together) as chunk:
            all_columns([b.add(b.mul(chunk.index, together), ir.Constant(I64, j)) for j in range(QUERIES_TOGETHER)])
        left = b.urem(n_group, together)
        for n_left in range(1, QUERIES_TOGETHER):
            with b.if_then(b.icmp_unsigned("==", left, ir.Constant(I64, n_left))):
                all_columns([b.add(first_left, ir.Constant(I64, j)) for j in range(n_left)])
        return context.get_dummy_value()
    return types.none(cache, kv, row_first, col_first, a, out), codegen
