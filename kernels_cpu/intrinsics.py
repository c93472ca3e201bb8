"""Small functions for Numba kernels, written in LLVM IR where Numba's own would not vectorize.

exp (Numba calls libm's, one element at a time) and float16 conversions: Numba has no float16
type, so a float16 KV cache (llama.cpp's default) is held as uint16 bits.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .ir import FAST, F32, I16, I32, I64, LANES, array_data, offset, splat, vector


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
def key_scores(typingctx, keys, kv, first, queries, scores):
    """scores[g, s] = sum_i queries[g, i] * keys[kv, i, first + s] for every g < len(queries) and
    s < scores.shape[1]; keys (kv heads, dim, slots) hold float32 or float16 bits, queries and
    scores are C-contiguous float32. Callers guarantee the bounds.

    Register-blocked: 64 slots in four 16-lane accumulators run down all dimensions, each key
    vector converted where it is loaded, so a multiply-add costs about two instructions.
    """
    element = ir.HalfType() if keys.dtype == types.uint16 else F32
    if keys.dtype not in (types.uint16, types.float32) or queries.dtype != types.float32:
        return None

    def codegen(context, b, signature, args):
        keys_type, _, _, queries_type, scores_type = signature.args
        keys_v, kv, first, queries_v, scores_v = args
        key_strides = cgutils.create_struct_proxy(keys_type)(context, b, value=keys_v).strides
        kv_stride, dim_stride, _ = cgutils.unpack_tuple(b, key_strides, 3)
        keys_ptr = offset(b, array_data(context, b, keys_type, keys_v),
                          b.add(b.mul(kv, kv_stride), b.mul(first, ir.Constant(I64, 2 if element != F32 else 4))))
        n_group, key_dim = cgutils.unpack_tuple(b, cgutils.create_struct_proxy(queries_type)(
            context, b, value=queries_v).shape, 2)
        n_slots = cgutils.unpack_tuple(b, cgutils.create_struct_proxy(scores_type)(
            context, b, value=scores_v).shape, 2)[1]
        q_ptr = b.bitcast(array_data(context, b, queries_type, queries_v), F32.as_pointer())
        s_ptr = b.bitcast(array_data(context, b, scores_type, scores_v), F32.as_pointer())
        in_vector, out_vector = vector(element), vector(F32)
        widen = (lambda v: b.fpext(v, out_vector)) if element != F32 else (lambda v: v)

        def block(g, first_slot, width):
            """Scores of query g for `width` x 16 slots from first_slot, in `width` accumulators."""
            accs = [cgutils.alloca_once_value(b, ir.Constant(out_vector, [0.0] * LANES)) for _ in range(width)]
            for acc in accs:
                b.store(ir.Constant(out_vector, [0.0] * LANES), acc)
            with cgutils.for_range(b, key_dim) as dims:
                q = splat(b, b.load(b.gep(q_ptr, [b.add(b.mul(g, key_dim), dims.index)])))
                row = offset(b, keys_ptr, b.mul(dims.index, dim_stride))
                for u, acc in enumerate(accs):
                    at = b.add(first_slot, ir.Constant(I64, u * LANES))
                    k = widen(b.load(b.bitcast(b.gep(b.bitcast(row, element.as_pointer()), [at]),
                                               in_vector.as_pointer()), align=2))
                    b.store(b.fadd(b.fmul(k, q, flags=FAST), b.load(acc), flags=FAST), acc)
            for u, acc in enumerate(accs):
                at = b.add(b.add(b.mul(g, n_slots), first_slot), ir.Constant(I64, u * LANES))
                b.store(b.load(acc), b.bitcast(b.gep(s_ptr, [at]), out_vector.as_pointer()), align=4)

        wide = 4 * LANES
        with cgutils.for_range(b, n_group) as groups:
            g = groups.index
            with cgutils.for_range(b, b.udiv(n_slots, ir.Constant(I64, wide))) as blocks:
                block(g, b.mul(blocks.index, ir.Constant(I64, wide)), 4)
            done = b.mul(b.udiv(n_slots, ir.Constant(I64, wide)), ir.Constant(I64, wide))
            with cgutils.for_range(b, b.udiv(b.sub(n_slots, done), ir.Constant(I64, LANES))) as blocks:
                block(g, b.add(done, b.mul(blocks.index, ir.Constant(I64, LANES))), 1)
            done = b.mul(b.udiv(n_slots, ir.Constant(I64, LANES)), ir.Constant(I64, LANES))
            with cgutils.for_range(b, b.sub(n_slots, done)) as slots:  # the last n mod 16, one by one
                s = b.add(done, slots.index)
                total = cgutils.alloca_once_value(b, ir.Constant(F32, 0.0))
                b.store(ir.Constant(F32, 0.0), total)
                with cgutils.for_range(b, key_dim) as dims:
                    row = offset(b, keys_ptr, b.mul(dims.index, dim_stride))
                    k = b.load(b.gep(b.bitcast(row, element.as_pointer()), [s]))
                    k = b.fpext(k, F32) if element != F32 else k
                    q = b.load(b.gep(q_ptr, [b.add(b.mul(g, key_dim), dims.index)]))
                    b.store(b.fadd(b.fmul(k, q, flags=FAST), b.load(total), flags=FAST), total)
                b.store(b.load(total), b.gep(s_ptr, [b.add(b.mul(g, n_slots), s)]))
        return context.get_dummy_value()
    return types.none(keys, kv, first, queries, scores), codegen


@intrinsic
def weighted_values(typingctx, values, kv, first, weights, out):
    """out[g, d] = sum_s weights[g, s] * values[kv, first + s, d] for every g < len(weights);
    values (kv heads, slots, dim) hold float32 or float16 bits with contiguous rows, weights and
    out are C-contiguous float32. Callers guarantee the bounds.

    Register-blocked like key_scores: 64 dimensions in four accumulators run down all slots.
    """
    element = ir.HalfType() if values.dtype == types.uint16 else F32
    if values.dtype not in (types.uint16, types.float32) or weights.dtype != types.float32:
        return None

    def codegen(context, b, signature, args):
        values_type, _, _, weights_type, out_type = signature.args
        values_v, kv, first, weights_v, out_v = args
        kv_stride, slot_stride, _ = cgutils.unpack_tuple(
            b, cgutils.create_struct_proxy(values_type)(context, b, value=values_v).strides, 3)
        values_ptr = offset(b, array_data(context, b, values_type, values_v),
                            b.add(b.mul(kv, kv_stride), b.mul(first, slot_stride)))
        n_group, n_slots = cgutils.unpack_tuple(b, cgutils.create_struct_proxy(weights_type)(
            context, b, value=weights_v).shape, 2)
        value_dim = cgutils.unpack_tuple(b, cgutils.create_struct_proxy(out_type)(context, b, value=out_v).shape, 2)[1]
        w_ptr = b.bitcast(array_data(context, b, weights_type, weights_v), F32.as_pointer())
        o_ptr = b.bitcast(array_data(context, b, out_type, out_v), F32.as_pointer())
        in_vector, out_vector = vector(element), vector(F32)

        def element_at(s, d):
            row = b.bitcast(offset(b, values_ptr, b.mul(s, slot_stride)), element.as_pointer())
            return b.gep(row, [d])

        def block(g, first_dim, width):
            accs = [cgutils.alloca_once_value(b, ir.Constant(out_vector, [0.0] * LANES)) for _ in range(width)]
            for acc in accs:
                b.store(ir.Constant(out_vector, [0.0] * LANES), acc)
            with cgutils.for_range(b, n_slots) as slots:
                w = splat(b, b.load(b.gep(w_ptr, [b.add(b.mul(g, n_slots), slots.index)])))
                for u, acc in enumerate(accs):
                    at = element_at(slots.index, b.add(first_dim, ir.Constant(I64, u * LANES)))
                    v = b.load(b.bitcast(at, in_vector.as_pointer()), align=2)
                    v = b.fpext(v, out_vector) if element != F32 else v
                    b.store(b.fadd(b.fmul(v, w, flags=FAST), b.load(acc), flags=FAST), acc)
            for u, acc in enumerate(accs):
                at = b.add(b.add(b.mul(g, value_dim), first_dim), ir.Constant(I64, u * LANES))
                b.store(b.load(acc), b.bitcast(b.gep(o_ptr, [at]), out_vector.as_pointer()), align=4)

        wide = 4 * LANES
        with cgutils.for_range(b, n_group) as groups:
            g = groups.index
            with cgutils.for_range(b, b.udiv(value_dim, ir.Constant(I64, wide))) as blocks:
                block(g, b.mul(blocks.index, ir.Constant(I64, wide)), 4)
            done = b.mul(b.udiv(value_dim, ir.Constant(I64, wide)), ir.Constant(I64, wide))
            with cgutils.for_range(b, b.udiv(b.sub(value_dim, done), ir.Constant(I64, LANES))) as blocks:
                block(g, b.add(done, b.mul(blocks.index, ir.Constant(I64, LANES))), 1)
            done = b.mul(b.udiv(value_dim, ir.Constant(I64, LANES)), ir.Constant(I64, LANES))
            with cgutils.for_range(b, b.sub(value_dim, done)) as dims:  # the last dim mod 16, one by one
                d = b.add(done, dims.index)
                total = cgutils.alloca_once_value(b, ir.Constant(F32, 0.0))
                b.store(ir.Constant(F32, 0.0), total)
                with cgutils.for_range(b, n_slots) as slots:
                    v = b.load(element_at(slots.index, d))
                    v = b.fpext(v, F32) if element != F32 else v
                    w = b.load(b.gep(w_ptr, [b.add(b.mul(g, n_slots), slots.index)]))
                    b.store(b.fadd(b.fmul(v, w, flags=FAST), b.load(total), flags=FAST), total)
                b.store(b.load(total), b.gep(o_ptr, [b.add(b.mul(g, value_dim), d)]))
        return context.get_dummy_value()
    return types.none(values, kv, first, weights, out), codegen
