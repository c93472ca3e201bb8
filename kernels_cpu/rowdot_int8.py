"""Rows of quantized weights dotted with 8-bit activations: decode's default products.

Each weight type multiplies activations rounded as llama.cpp rounds them for it (activations.py):
the 32-weight types Q8_0 blocks, the K-quants Q8_K super-blocks. The weights' integers stay
unsigned bytes (block_ir.py leaves Q4_0's 8, Q6_K's 32 ... apart as the group's offset), so one
vpmaddubsw or vpdpbusd multiplies 32 of them with 32 activations, twice the products per
instruction of the 16-bit path in rowdot.py. An offset then costs one product with the
activations' sums per block; so do the mins of the affine types. Only the weights of Q8_0 and
the IQ4 types are signed: they multiply by magnitude with the activations' signs flipped to match
(vpsignb).

Per 32-weight block: four-product sums in 8 int32 lanes, one conversion to float and one
multiply-add by the block's scale times the activations'. Per K-quant super-block: its units'
pair sums (vpmaddubsw) times their groups' integer scales (vpmaddwd) add up as integers over all
256 weights, then convert once. The only horizontal sum is at the end of a row.
"""
from gguf import GGML_QUANT_SIZES
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .block_ir import DECODERS, negated_where
from .cpu_features import int8_isa
from .ir import (F32, FAST, I8, I16, I32, I64, array_row, array_shape, byte_pair_sums, byte_quad_sums, concat,
                 const_vector, horizontal_sum, load_vector, mul_add, offset, pair_products, pair_products_into,
                 signed_byte_pair_sums, signed_byte_quad_sums, splat, splat_float, vector, word_picks)
from .rowdot import _units, emit_rows, switch_on_type
from .type_sets import tagged_types

LANES8 = 8  # int32 / float32 lanes of a 256-bit register, the width of the 8-bit products
# 32-weight blocks per loop step, each adding into its own accumulator, so that consecutive
# multiply-adds need not wait for one another.
BLOCKS_PER_STEP = 4


def _zeros(element, n=LANES8):
    return ir.Constant(vector(element, n), [0] * n if element != F32 else [0.0] * n)


def _values(b, groups):
    """The 32 values of consecutive groups as one <32 x i8>."""
    values = [v for grp in groups for v in grp.values]
    return values[0] if len(values) == 1 else concat(b, *values)


def _unit_bits(b, groups):
    """The negative bits (block_ir.Group.negative) of consecutive groups as one integer."""
    bits, at = None, 0
    for grp in groups:
        part = b.zext(grp.negative, I32) if grp.negative.type.width < 32 else grp.negative
        part = b.shl(part, ir.Constant(I32, at)) if at else part
        bits = part if bits is None else b.or_(bits, part)
        at += sum(v.type.count for v in grp.values)
    return bits


def _emit_blocks32(b, isa, qtype, row_ptr, row_bytes, act):
    """The dot product of a row of a 32-weight type with Q8_0 activations, as float32."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    decode = DECODERS[qtype]
    n_blocks = b.udiv(row_bytes, ir.Constant(I64, block_bytes))
    accs = [cgutils.alloca_once_value(b, _zeros(F32)) for _ in range(BLOCKS_PER_STEP)]
    # mins times sums, one chain per step slot as for accs (one chain waited ~4 cycles per block)
    min_accs = [cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(BLOCKS_PER_STEP)]

    def emit_block(i, slot):
        acc, min_acc = accs[slot], min_accs[slot]
        xq = load_vector(b, act["q32"], b.mul(i, ir.Constant(I64, 32)), I8, 32)
        dx = splat(b, b.load(b.gep(b.bitcast(act["d32"], F32.as_pointer()), [i])), LANES8)
        (grp,) = decode(b, offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes)))).groups
        values = _values(b, [grp])
        if grp.signed:
            ints = signed_byte_quad_sums(b, isa, _zeros(I32), values, xq)
        else:
            ints = byte_quad_sums(b, isa, _zeros(I32), values, xq)
        if grp.offset:  # minus offset * sum(xq), in one lane: only the row's total matters
            block_sum = b.load(b.gep(b.bitcast(act["sum32"], I32.as_pointer()), [i]))
            correction = b.mul(block_sum, ir.Constant(I32, grp.offset))
            ints = b.sub(ints, b.insert_element(_zeros(I32), correction, ir.Constant(I32, 0)))
        scale = b.fmul(splat_float(b, grp.scale, LANES8), dx, flags=FAST)
        b.store(mul_add(b, b.sitofp(ints, vector(F32, LANES8)), scale, b.load(acc)), acc)
        if grp.bias is not None:  # the block's min times the activations' sum
            scaled_sum = b.load(b.gep(b.bitcast(act["ssum32"], F32.as_pointer()), [i]))
            b.store(mul_add(b, grp.bias, scaled_sum, b.load(min_acc)), min_acc)

    steps = b.udiv(n_blocks, ir.Constant(I64, BLOCKS_PER_STEP))
    with cgutils.for_range(b, steps) as loop:
        first = b.mul(loop.index, ir.Constant(I64, BLOCKS_PER_STEP))
        for u in range(BLOCKS_PER_STEP):
            emit_block(b.add(first, ir.Constant(I64, u)), u)
    with cgutils.for_range(b, b.urem(n_blocks, ir.Constant(I64, BLOCKS_PER_STEP))) as loop:
        emit_block(b.add(b.mul(steps, ir.Constant(I64, BLOCKS_PER_STEP)), loop.index), 0)
    total = horizontal_sum(b, _float_sum(b, [b.load(acc) for acc in accs]))
    return b.fadd(total, _float_sum(b, [b.load(acc) for acc in min_accs]), flags=FAST)


def _float_sum(b, values):
    while len(values) > 1:
        values = [b.fadd(values[i], values[i + 1], flags=FAST) for i in range(0, len(values), 2)]
    return values[0]


def tree_sum(b, values):
    """The integer vectors' sum, added pairwise."""
    while len(values) > 1:
        values = [b.add(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _emit_super_blocks(b, isa, qtype, row_ptr, row_bytes, act):
    """The dot product of a row of a K-quant with Q8_K activations, as float32."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    decode = DECODERS[qtype]
    n_blocks = b.udiv(row_bytes, ir.Constant(I64, block_bytes))
    acc = cgutils.alloca_once_value(b, _zeros(F32))
    min_acc = cgutils.alloca_once_value(b, _zeros(F32))

    with cgutils.for_range(b, n_blocks) as loop:
        i = loop.index
        first_weight = b.mul(i, ir.Constant(I64, block))
        dx = b.load(b.gep(b.bitcast(act["d256"], F32.as_pointer()), [i]))
        sums = load_vector(b, act["sum16"], b.mul(i, ir.Constant(I64, 16)), I16, 16)  # 16 per super-block
        xqs = [load_vector(b, act["q256"], b.add(first_weight, ir.Constant(I64, 32 * u)), I8, 32)
               for u in range(block // 32)]
        blk = decode(b, offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
        n_groups = len(blk.groups)
        products, first_group = [], 0
        for unit, xq in zip(_units(blk.groups), xqs):
            # lanes 0-7 of the pair sums hold weights 0-15 of the unit, lanes 8-15 the rest
            multipliers = word_picks(b, isa, blk.scales, [first_group + j * len(unit) // 16 for j in range(16)])
            pair_sums = signed_byte_pair_sums if unit[0].signed else byte_pair_sums
            if unit[0].negative is not None:  # (magnitudes: the activations take their signs)
                xq = negated_where(b, xq, _unit_bits(b, unit))
            products.append((pair_sums(b, isa, _values(b, unit), xq), multipliers))
            first_group += len(unit)
        per_sum = [g * n_groups // 16 for g in range(16)]  # the group of each sum of 16
        group_offset = blk.groups[0].offset
        if group_offset:  # minus offset * scale * sum(xq) per group
            scaled = b.mul(b.shuffle_vector(blk.scales, blk.scales, const_vector(I32, per_sum)),
                           const_vector(I16, [-group_offset] * 16))
            products.append((scaled, sums))
        # the units' products scaled, in pairs of two chained multiply-adds, the pairs added up
        pairs = [pair_products_into(b, isa, pair_products(b, *products[i]), *products[i + 1])
                 if i + 1 < len(products) else pair_products(b, *products[i]) for i in range(0, len(products), 2)]
        total = tree_sum(b, pairs)
        b.store(mul_add(b, b.sitofp(total, vector(F32, LANES8)), splat(b, b.fmul(blk.d, dx, flags=FAST), LANES8),
                        b.load(acc)), acc)
        if blk.mins is not None:  # minus dmin * min * sum(xq) per group
            mins = b.shuffle_vector(blk.mins, blk.mins, const_vector(I32, per_sum))
            products = b.sitofp(pair_products(b, mins, sums), vector(F32, LANES8))
            scale = splat(b, b.fneg(b.fmul(blk.dmin, dx, flags=FAST)), LANES8)
            b.store(mul_add(b, products, scale, b.load(min_acc)), min_acc)
    return horizontal_sum(b, b.fadd(b.load(acc), b.load(min_acc), flags=FAST))


ACTIVATIONS = ("q32", "d32", "sum32", "ssum32", "q256", "d256", "sum16")


@intrinsic
def rows_dot_int8(typingctx, kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col):
    """out[t, col + r - first] = row r of the raw blocks w (rows, bytes per row) of type qtype
    dotted with x[t], for rows first <= r < last and every token t < len(out), x given in the
    format of activations.py that the type pairs with: quantize_q8_0's (q32, d32, sum32, ssum32)
    for 32-weight types, quantize_q8_k's (q256, d256, sum16) for K-quants (the other format is
    not read). Callers guarantee last <= len(w), x as long as a row for every token of out,
    col + last - first <= out.shape[1] and a qtype of those the array kinds' dtype names
    (type_sets)."""
    isa = int8_isa()
    qtypes = [t for t in tagged_types(kinds) if t in DECODERS]

    def codegen(context, b, signature, args):
        _, qtype_v, wv, first_v, last_v, *act_values, outv, colv = args
        w_type = signature.args[2]
        row_bytes = array_shape(context, b, w_type, wv)[1]
        act_arrays = list(zip(signature.args[5:12], act_values))

        def emit(qt):
            emit_row = _emit_super_blocks if GGML_QUANT_SIZES[qt][0] == 256 else _emit_blocks32

            def row_dot(rows, tokens):
                (row,), (t,) = rows, tokens
                act = {name: array_row(context, b, ty, v, t) for name, (ty, v) in zip(ACTIVATIONS, act_arrays)}
                return [[emit_row(b, isa, qt, array_row(context, b, w_type, wv, row), row_bytes, act)]]
            emit_rows(context, b, first_v, last_v, (signature.args[12], outv), colv, row_dot)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col), codegen
