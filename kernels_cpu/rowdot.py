"""Rows of quantized weights, straight from the GGUF blocks where the file maps them: dot
products with float32 activations (row_dot) and dequantization to float32 (row_dequantize).

Both are one skeleton for every type, over the block decoders of block_ir.py. In row_dot each
group's values multiply the activations lane-wise and join 16-lane accumulators through the
group's scale, so the only horizontal sum is the one at the end of the row; mins of the affine
types use sums of the activations (xsum), computed once per product.
"""
from gguf import GGML_QUANT_SIZES
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .block_ir import DECODERS
from .ir import (F32, FAST, I64, LANES, array_row, array_shape, horizontal_sum, load_floats, mul_add, offset, prefetch,
                 splat, vector)


# Independent accumulator chains, so that consecutive groups' multiply-adds need not wait for one
# another (an FMA takes 4 cycles, a group's other work about as long); 32-weight blocks are also
# unrolled in pairs to give each loop step enough groups to spread.
ACCUMULATORS = 4
# Rows stream from memory; asking for the bytes ~2 KiB ahead measured 10-25% faster than the
# hardware prefetcher alone on the 96 MB of SmolLM2's matrices (2 threads).
PREFETCH_AHEAD = 2048
BLOCKS_PER_STEP = {32: 2}


def _emit_row(b, qtype, row_ptr, row_bytes, x_ptr, xsum_ptr):
    """IR for the dot product of one row of qtype blocks; returns the float32 sum."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    decode = DECODERS[qtype]
    n_blocks = b.udiv(row_bytes, ir.Constant(I64, block_bytes))
    accs = [cgutils.alloca_once_value(b, ir.Constant(vector(F32), [0.0] * LANES))
            for _ in range(ACCUMULATORS)]
    bias_accs = [cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(ACCUMULATORS)]

    def emit_block(i, slot):
        """Block i's groups, each added into the next accumulator in turn."""
        first_weight = b.mul(i, ir.Constant(I64, block))
        position = 0
        block_ptr = offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes)))
        prefetch(b, offset(b, block_ptr, PREFETCH_AHEAD))
        for grp in decode(b, block_ptr):
            group_start = position
            products = None
            for values in grp.values:
                xs = load_floats(b, x_ptr, b.add(first_weight, ir.Constant(I64, position)))
                position += LANES
                products = b.fmul(values, xs, flags=FAST) if products is None else mul_add(b, values, xs, products)
            acc = accs[slot % ACCUMULATORS]
            b.store(mul_add(b, products, splat(b, grp.scale), b.load(acc)), acc)
            if grp.bias is not None:  # xsum holds a sum per 16 activations: one per vector of the group
                first_sum = b.add(b.mul(i, ir.Constant(I64, block // LANES)), ir.Constant(I64, group_start // LANES))
                sums = [b.load(b.gep(b.bitcast(xsum_ptr, F32.as_pointer()), [b.add(first_sum, ir.Constant(I64, j))]))
                        for j in range(len(grp.values))]
                xsum_g = sums[0] if len(sums) == 1 else b.fadd(sums[0], sums[1], flags=FAST)
                bias_acc = bias_accs[slot % ACCUMULATORS]
                b.store(mul_add(b, grp.bias, xsum_g, b.load(bias_acc)), bias_acc)
            slot += 1
        return slot

    unroll = BLOCKS_PER_STEP.get(block, 1)
    steps = b.udiv(n_blocks, ir.Constant(I64, unroll))
    with cgutils.for_range(b, steps) as loop:
        slot = 0
        for u in range(unroll):
            slot = emit_block(b.add(b.mul(loop.index, ir.Constant(I64, unroll)), ir.Constant(I64, u)), slot)
    with cgutils.for_range(b, b.urem(n_blocks, ir.Constant(I64, unroll))) as loop:
        emit_block(b.add(b.mul(steps, ir.Constant(I64, unroll)), loop.index), 0)
    total, bias_total = b.load(accs[0]), b.load(bias_accs[0])
    for acc, bias_acc in zip(accs[1:], bias_accs[1:]):
        total = b.fadd(total, b.load(acc), flags=FAST)
        bias_total = b.fadd(bias_total, b.load(bias_acc), flags=FAST)
    return b.fadd(horizontal_sum(b, total), bias_total, flags=FAST)


def _switch_on_type(b, qtype_value, emit):
    """One IR branch per quantized type, each built by emit(type); the type is dispatched once
    per row, outside the block loop. An unknown type falls through (callers validate types)."""
    done = b.append_basic_block("qtype.done")
    switch = b.switch(b.sext(qtype_value, I64) if qtype_value.type != I64 else qtype_value, done)
    for qt in DECODERS:
        case = b.append_basic_block(f"qtype.{qt.name}")
        switch.add_case(ir.Constant(I64, int(qt)), case)
        b.position_at_end(case)
        emit(qt)
        b.branch(done)
    b.position_at_end(done)


@intrinsic
def row_dot(typingctx, qtype, w, row, x, t, xsum):
    """Row `row` of the raw blocks w (rows, bytes per row) of type qtype dotted with x[t]; xsum[t]
    holds the sums of x[t]'s consecutive 16-weight runs. Callers guarantee row < len(w), x[t] as
    long as a row, and a qtype in DECODERS."""
    def codegen(context, b, signature, args):
        _, w_type, _, x_type, _, xsum_type = signature.args
        qtype_v, wv, rowv, xv, tv, xsumv = args

        row_ptr = array_row(context, b, w_type, wv, rowv)
        x_ptr, xsum_ptr = array_row(context, b, x_type, xv, tv), array_row(context, b, xsum_type, xsumv, tv)
        row_bytes = array_shape(context, b, w_type, wv)[1]
        result = cgutils.alloca_once_value(b, ir.Constant(F32, float("nan")))
        _switch_on_type(b, qtype_v, lambda qt: b.store(_emit_row(b, qt, row_ptr, row_bytes, x_ptr, xsum_ptr), result))
        return b.load(result)
    return types.float32(qtype, w, row, x, t, xsum), codegen


def _emit_dequantize(b, qtype, row_ptr, row_bytes, out_ptr):
    """IR writing one row of qtype blocks as float32 at out_ptr: scale * value + bias per group."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    with cgutils.for_range(b, b.udiv(row_bytes, ir.Constant(I64, block_bytes))) as loop:
        position = b.mul(loop.index, ir.Constant(I64, block))
        for grp in DECODERS[qtype](b, offset(b, row_ptr, b.mul(loop.index, ir.Constant(I64, block_bytes)))):
            scale = splat(b, grp.scale)
            bias = splat(b, grp.bias) if grp.bias is not None else None
            for values in grp.values:
                weights = b.fmul(values, scale) if bias is None else mul_add(b, values, scale, bias)
                target = b.gep(b.bitcast(out_ptr, F32.as_pointer()), [position])
                b.store(weights, b.bitcast(target, vector(F32).as_pointer()), align=4)
                position = b.add(position, ir.Constant(I64, LANES))


@intrinsic
def row_dequantize(typingctx, qtype, w, row, out, out_row):
    """out[out_row] = row `row` of the raw blocks w as float32; callers guarantee the bounds."""
    def codegen(context, b, signature, args):
        _, w_type, _, out_type, _ = signature.args
        qtype_v, wv, rowv, outv, out_rowv = args
        row_ptr, out_ptr = array_row(context, b, w_type, wv, rowv), array_row(context, b, out_type, outv, out_rowv)
        row_bytes = array_shape(context, b, w_type, wv)[1]
        _switch_on_type(b, qtype_v, lambda qt: _emit_dequantize(b, qt, row_ptr, row_bytes, out_ptr))
        return context.get_dummy_value()
    return types.none(qtype, w, row, out, out_row), codegen
