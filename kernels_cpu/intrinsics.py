"""Small functions for Numba kernels, written in LLVM IR where Numba's own would not vectorize.

exp (Numba calls libm's, one element at a time) and float16 conversions: Numba has no float16
type, so a float16 KV cache (llama.cpp's default) is held as uint16 bits.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .ir import FAST, F32, I16, I32, I64, LANES, array_data, array_shape, array_strides, offset, splat, vector


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


@intrinsic
def from_f32(typingctx, value, like):
    """value as an element of the array `like`: float16 bits (uint16, rounded to nearest even) or float32."""
    if like.dtype == types.uint16:
        return types.uint16(value, like), lambda context, b, sig, args: b.bitcast(b.fptrunc(args[0], ir.HalfType()), I16)
    if like.dtype == types.float32:
        return types.float32(value, like), lambda context, b, sig, args: (
            args[0] if args[0].type == F32 else b.fptrunc(args[0], F32))
    return None


@intrinsic
def cache_product(typingctx, cache, kv, row_first, col_first, a, out):
    """out[g, c] = sum_r a[g, r] * cache[kv, row_first + r, col_first + c] for g < len(a),
    r < a.shape[1], c < out.shape[1]: a small matrix product against a block of a KV cache, which
    holds float32 or float16 bits with contiguous last dimension; a and out are C-contiguous
    float32. Callers guarantee the bounds. Attention uses it twice: scores are queries times keys
    (kv heads, dim, slots), outputs are weights times values (kv heads, slots, dim).

    Register-blocked: 64 columns in four 16-lane accumulators run down all rows, each cache vector
    converted where it is loaded, so a multiply-add costs about two instructions.
    """
    element = ir.HalfType() if cache.dtype == types.uint16 else F32
    if cache.dtype not in (types.uint16, types.float32) or a.dtype != types.float32:
        return None

    def codegen(context, b, signature, args):
        cache_type, _, _, _, a_type, out_type = signature.args
        cache_v, kv, row_first, col_first, a_v, out_v = args
        kv_stride, row_stride, col_stride = array_strides(context, b, cache_type, cache_v)
        base = offset(b, array_data(context, b, cache_type, cache_v),
                      b.add(b.add(b.mul(kv, kv_stride), b.mul(row_first, row_stride)), b.mul(col_first, col_stride)))
        n_group, n_rows = array_shape(context, b, a_type, a_v)
        n_cols = array_shape(context, b, out_type, out_v)[1]
        a_ptr = b.bitcast(array_data(context, b, a_type, a_v), F32.as_pointer())
        out_ptr = b.bitcast(array_data(context, b, out_type, out_v), F32.as_pointer())
        widen = (lambda v, t: b.fpext(v, t)) if element != F32 else (lambda v, t: v)

        def cache_at(r, c):
            return b.gep(b.bitcast(offset(b, base, b.mul(r, row_stride)), element.as_pointer()), [c])

        def a_at(g, r):
            return b.load(b.gep(a_ptr, [b.add(b.mul(g, n_rows), r)]))

        def columns(g, first, width, lanes):
            """out[g, first : first + width * lanes] from `width` accumulators of `lanes` lanes."""
            acc_type = vector(F32, lanes) if lanes > 1 else F32
            zero = ir.Constant(acc_type, [0.0] * lanes if lanes > 1 else 0.0)
            accs = [cgutils.alloca_once_value(b, zero) for _ in range(width)]
            for acc in accs:
                b.store(zero, acc)
            with cgutils.for_range(b, n_rows) as rows:
                weight = a_at(g, rows.index)
                weight = splat(b, weight, lanes) if lanes > 1 else weight
                for u, acc in enumerate(accs):
                    at = cache_at(rows.index, b.add(first, ir.Constant(I64, u * lanes)))
                    if lanes > 1:
                        at = b.bitcast(at, vector(element, lanes).as_pointer())
                    value = widen(b.load(at, align=2), acc_type)
                    b.store(b.fadd(b.fmul(value, weight, flags=FAST), b.load(acc), flags=FAST), acc)
            for u, acc in enumerate(accs):
                at = b.gep(out_ptr, [b.add(b.add(b.mul(g, n_cols), first), ir.Constant(I64, u * lanes))])
                b.store(b.load(acc), b.bitcast(at, acc_type.as_pointer()) if lanes > 1 else at, align=4)

        with cgutils.for_range(b, n_group) as groups:
            done = ir.Constant(I64, 0)
            for width, lanes in ((4, LANES), (1, LANES), (1, 1)):  # 64 columns at a time, then 16, then 1
                step = ir.Constant(I64, width * lanes)
                count = b.udiv(b.sub(n_cols, done), step)
                start = done
                with cgutils.for_range(b, count) as blocks:
                    columns(groups.index, b.add(start, b.mul(blocks.index, step)), width, lanes)
                done = b.add(done, b.mul(count, step))
        return context.get_dummy_value()
    return types.none(cache, kv, row_first, col_first, a, out), codegen
