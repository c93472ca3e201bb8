"""Small functions for Numba kernels, written in LLVM IR where Numba's own would not vectorize.

exp (Numba calls libm's, one element at a time) and float16 conversions: Numba has no float16
type, so a float16 KV cache (llama.cpp's default) is held as uint16 bits.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .ir import F32, I16, I32, I64, LANES, array_data, vector


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
def to_f32_run(typingctx, src, dst):
    """dst[i] = float32 of src[i] for i < len(dst), both runs contiguous; src holds float32, or
    float16 bits (uint16) of which each 16-value vector converts in one instruction (vcvtph2ps)."""
    element = ir.HalfType() if src.dtype == types.uint16 else F32

    def codegen(context, b, signature, args):
        src_type, dst_type = signature.args
        src_ptr = b.bitcast(array_data(context, b, src_type, args[0]), element.as_pointer())
        dst_ptr = b.bitcast(array_data(context, b, dst_type, args[1]), F32.as_pointer())
        n = cgutils.unpack_tuple(b, cgutils.create_struct_proxy(dst_type)(context, b, value=args[1]).shape, 1)[0]
        widen = (lambda v, t: b.fpext(v, t)) if element != F32 else (lambda v, t: v)
        in_vector, out_vector = vector(element), vector(F32)
        with cgutils.for_range(b, b.udiv(n, ir.Constant(I64, LANES))) as loop:
            at = b.mul(loop.index, ir.Constant(I64, LANES))
            values = b.load(b.bitcast(b.gep(src_ptr, [at]), in_vector.as_pointer()), align=2)
            b.store(widen(values, out_vector), b.bitcast(b.gep(dst_ptr, [at]), out_vector.as_pointer()), align=4)
        with cgutils.for_range(b, b.urem(n, ir.Constant(I64, LANES))) as loop:
            at = b.add(b.mul(b.udiv(n, ir.Constant(I64, LANES)), ir.Constant(I64, LANES)), loop.index)
            b.store(widen(b.load(b.gep(src_ptr, [at])), F32), b.gep(dst_ptr, [at]))
        return context.get_dummy_value()
    if src.dtype not in (types.uint16, types.float32) or dst.dtype != types.float32:
        return None
    return types.none(src, dst), codegen


@intrinsic
def from_f32(typingctx, value, like):
    """value as an element of the array `like`: float16 bits (uint16, rounded to nearest even) or float32."""
    if like.dtype == types.uint16:
        return types.uint16(value, like), lambda context, b, sig, args: b.bitcast(b.fptrunc(args[0], ir.HalfType()), I16)
    if like.dtype == types.float32:
        return types.float32(value, like), lambda context, b, sig, args: (
            args[0] if args[0].type == F32 else b.fptrunc(args[0], F32))
    return None
