"""Rows of quantized weights, straight from the GGUF blocks where the file maps them: dot
products with activations (rows_dot) and dequantization to float32 (row_dequantize).

Both are one skeleton for every type, over the block decoders of block_ir.py. In the dot
products, each 32-weight unit's integers multiply 16-bit activations in integer lanes and join
16-lane float accumulators through the unit's scale, so the only horizontal sum is the one at the
end of a row; mins of the affine types use sums of the activations (xsum), computed once per
product.
"""
from gguf import GGML_QUANT_SIZES
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .block_ir import DECODERS, MIN_OFFSET
from .type_sets import tagged_types
from .ir import (F32, FAST, I16, I32, I64, LANES, array_row, array_shape, concat, const_vector, horizontal_sum,
                 lanes_below, load_vector, masked_load, mul_add, offset, pair_products, splat, splat_float, to_float,
                 vector, widen)


# Independent accumulator chains, so that consecutive groups' multiply-adds need not wait for one
# another (an FMA takes 4 cycles, a group's other work about as long).
ACCUMULATORS = 4
# Activations share a float scale per this many values (see activations.quantize_int16): a
# K-quant super-block's integer products then add up before any conversion, and the blocks of
# 32 weights within one add up as floats before one multiplication by it (unrolled, 8 blocks
# per loop step).
DX_BLOCK = 256


def _units(groups):
    """A block's groups as 32-weight units: one 32-weight group, or two consecutive 16-weight ones."""
    units, pending = [], []
    for grp in groups:
        pending.append(grp)
        if sum(v.type.count for g in pending for v in g.values) == 2 * LANES:
            units.append(pending)
            pending = []
    return units


def _emit_row(b, qtype, row_ptr, min_ptr, row_bytes, xq_ptr, dx_ptr, xsum_ptr):
    """IR for the dot product of a row of qtype blocks with one activation vector, given as
    16-bit integers xq with a float scale dx per DX_BLOCK values (x ~ dx * xq); returns its
    float32 sum.

    Per 32-weight unit, the weights' integers (widened to 16 bits) and xq multiply and add in
    pairs into 16 int32 lanes (one vpmaddwd, or vpdpwssd with VNNI: 32 products per instruction,
    against 16 for a float FMA after converting every weight to float). A block of one unit then
    takes one conversion to float and one multiply-add by its scale times dx; a K-quant
    super-block first multiplies its units by their integer sub-scales (16-bit lanes) and adds
    them up as integers, so it converts once for 256 weights.

    The mins of 32-weight affine blocks (Q4_1, Q5_1) come from min_ptr, the row's float16 mins
    side by side: eight blocks' mins times their activation sums are one vector multiply-add,
    where reading each from its block cost three scalar instructions of the ~12 per block.
    """
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    decode = DECODERS[qtype]
    n_blocks = b.udiv(row_bytes, ir.Constant(I64, block_bytes))
    zero = ir.Constant(vector(F32), [0.0] * LANES)

    def accumulators():
        return [cgutils.alloca_once_value(b, zero) for _ in range(ACCUMULATORS)]
    accs = accumulators()
    min_acc = cgutils.alloca_once_value(b, zero)  # mins, lane per group or block
    # 32-weight blocks add up without dx into these, times dx once per DX_BLOCK weights
    chunk_accs = accumulators() if block < DX_BLOCK else None

    def emit_block(i, slot):
        """Block i of the row, added into the row's accumulator `slot` (of chunk_accs for
        32-weight blocks)."""
        first_weight = b.mul(i, ir.Constant(I64, block))
        blk = decode(b, offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
        units = _units(blk.groups)
        xqs = [load_vector(b, xq_ptr, b.add(first_weight, ir.Constant(I64, 2 * LANES * u)), I16, 2 * LANES)
               for u in range(len(units))]
        if blk.d is None:  # one unit, float scale (its min: see emit_chunk)
            (grp,) = blk.groups
            acc = chunk_accs[slot % ACCUMULATORS]
            products = b.sitofp(pair_products(b, _unit_ints(b, units[0]), xqs[0]), vector(F32))
            b.store(mul_add(b, products, splat_float(b, grp.scale), b.load(acc)), acc)
            return
        acc = accs[slot % ACCUMULATORS]
        dx = _dx(b, dx_ptr, first_weight)
        total, first_group = None, 0
        for unit, xq in zip(units, xqs):  # each unit's weights times their groups' scales
            lanes = [first_group + i * len(unit) // (2 * LANES) for i in range(2 * LANES)]
            multipliers = b.shuffle_vector(blk.scales, blk.scales, const_vector(I32, lanes))
            products = pair_products(b, b.mul(_unit_ints(b, unit), multipliers), xq)
            total = products if total is None else b.add(total, products)
            first_group += len(unit)
        b.store(mul_add(b, b.sitofp(total, vector(F32)), splat(b, b.fmul(blk.d, dx, flags=FAST)), b.load(acc)), acc)
        if blk.mins is not None:  # the groups' mins times their activation sums, times -dmin
            group_sums = _k_group_sums(b, blk, first_weight, xsum_ptr)
            mins = b.fmul(b.sitofp(blk.mins, vector(F32, len(blk.groups))), group_sums, flags=FAST)
            b.store(mul_add(b, _widen_lanes(b, mins), splat(b, b.fneg(blk.dmin)), b.load(min_acc)), min_acc)

    if chunk_accs is None:  # a block is a chunk of DX_BLOCK weights
        with cgutils.for_range(b, n_blocks) as loop:
            emit_block(loop.index, 0)
    else:
        per_chunk = DX_BLOCK // block

        def emit_chunk(first_block, count):
            """`count` blocks from first_block (an int: unrolled, else a loop), into chunk_accs,
            then those times their dx into accs."""
            for acc in chunk_accs:
                b.store(zero, acc)
            if isinstance(count, int):
                for u in range(count):
                    emit_block(b.add(first_block, ir.Constant(I64, u)), u)
            else:
                with cgutils.for_range(b, count) as loop:
                    emit_block(b.add(first_block, loop.index), 0)
            dx = splat(b, _dx(b, dx_ptr, b.mul(first_block, ir.Constant(I64, block))))
            for acc, chunk_acc in zip(accs, chunk_accs):
                b.store(mul_add(b, b.load(chunk_acc), dx, b.load(acc)), acc)
            if qtype in MIN_OFFSET:  # the chunk's mins times their blocks' activation sums
                mask = None if isinstance(count, int) else lanes_below(b, count, per_chunk)
                sums = _block_sums(b, xsum_ptr, first_block, per_chunk, mask)
                at = b.bitcast(offset(b, min_ptr, b.mul(first_block, ir.Constant(I64, 2))),
                               vector(ir.HalfType(), per_chunk).as_pointer())
                mins = b.fpext(b.load(at, align=2) if mask is None else masked_load(b, at, mask, 2),
                               vector(F32, per_chunk))
                b.store(mul_add(b, _widen_lanes(b, mins), _widen_lanes(b, sums), b.load(min_acc)), min_acc)

        full_chunks = b.udiv(n_blocks, ir.Constant(I64, per_chunk))
        with cgutils.for_range(b, full_chunks) as loop:
            emit_chunk(b.mul(loop.index, ir.Constant(I64, per_chunk)), per_chunk)
        rest = b.urem(n_blocks, ir.Constant(I64, per_chunk))
        with b.if_then(b.icmp_unsigned(">", rest, ir.Constant(I64, 0))):
            emit_chunk(b.mul(full_chunks, ir.Constant(I64, per_chunk)), rest)
    total = b.load(min_acc)
    for acc in accs:
        total = b.fadd(total, b.load(acc), flags=FAST)
    return horizontal_sum(b, total)


def _dx(b, dx_ptr, first_weight):
    """The activations' scale over the DX_BLOCK weights from first_weight."""
    return b.load(b.gep(b.bitcast(dx_ptr, F32.as_pointer()), [b.udiv(first_weight, ir.Constant(I64, DX_BLOCK))]))


def _unit_ints(b, unit):
    """A unit's 32 integers widened to <32 x i16>."""
    integers = [grp.integers(b) for grp in unit]
    values = [v for vs, _ in integers for v in vs]
    return widen(b, values[0] if len(values) == 1 else concat(b, *values), I16, integers[0][1])


def _k_group_sums(b, blk, first_weight, xsum_ptr):
    """For a K-quant block with mins, the activation sums under its groups, one lane per group,
    from xsum's sums of 16 (added in pairs for 32-weight groups); else None."""
    if blk.mins is None:
        return None
    sums = load_vector(b, xsum_ptr, b.udiv(first_weight, ir.Constant(I64, LANES)), F32)
    if len(blk.groups) == LANES:
        return sums
    return _pair_sums(b, sums)


def _block_sums(b, xsum_ptr, first_block, n, mask):
    """<n x float>: the activation sums under n 32-weight blocks from first_block (xsum's sums of
    16 in pairs); only the lanes of mask, when given."""
    at = b.bitcast(b.gep(b.bitcast(xsum_ptr, F32.as_pointer()), [b.mul(first_block, ir.Constant(I64, 2))]),
                   vector(F32, 2 * n).as_pointer())
    if mask is None:
        return _pair_sums(b, b.load(at, align=4))
    pairs = b.shuffle_vector(mask, mask, const_vector(I32, [i // 2 for i in range(2 * n)]))
    return _pair_sums(b, masked_load(b, at, pairs, 4))


def _pair_sums(b, v):
    n = v.type.count
    return b.fadd(b.shuffle_vector(v, v, const_vector(I32, range(0, n, 2))),
                  b.shuffle_vector(v, v, const_vector(I32, range(1, n, 2))), flags=FAST)


def _widen_lanes(b, v):
    """v with zeros appended up to LANES lanes."""
    n = v.type.count
    return b.shuffle_vector(v, ir.Constant(v.type, [0.0] * n), const_vector(I32, [min(i, n) for i in range(LANES)]))


def switch_on_type(b, qtype_value, emit, qtypes):
    """One IR branch per quantized type of qtypes (type_sets: the model's), each built by
    emit(type); the type is dispatched once per call, outside the row and block loops. Another
    type falls through (callers validate types)."""
    done = b.append_basic_block("qtype.done")
    switch = b.switch(b.sext(qtype_value, I64) if qtype_value.type != I64 else qtype_value, done)
    for qt in qtypes:
        case = b.append_basic_block(f"qtype.{qt.name}")
        switch.add_case(ir.Constant(I64, int(qt)), case)
        b.position_at_end(case)
        emit(qt)
        b.branch(done)
    b.position_at_end(done)


@intrinsic
def rows_dot(typingctx, kinds, qtype, w, mins, first, last, xq, dx, xsum, out, col):
    """out[t, col + r - first] = row r of the raw blocks w (rows, bytes per row) of type qtype
    dotted with x[t], for rows first <= r < last and every token t < len(out); for types in
    MIN_OFFSET, mins holds each row's float16 block mins as uint16 (rows, blocks per row), else
    it is not read. x is given as x[t, j] ~ dx[t, j // DX_BLOCK] * xq[t, j] (see
    activations.quantize_int16), and xsum[t] holds the sums of x[t]'s consecutive 16-weight runs.
    Callers guarantee last <= len(w), mins as described, x as long as a row for every token of
    out, col + last - first <= out.shape[1] and a qtype of those the array kinds' dtype names
    (type_sets)."""
    qtypes = [t for t in tagged_types(kinds) if t in DECODERS]

    def codegen(context, b, signature, args):
        _, _, w_type, mins_type, _, _, xq_type, dx_type, xsum_type, out_type, _ = signature.args
        _, qtype_v, wv, minsv, first_v, last_v, xqv, dxv, xsumv, outv, colv = args
        row_bytes = array_shape(context, b, w_type, wv)[1]

        def emit(qt):
            def row_dot(rows, tokens):
                (row,), (t,) = rows, tokens
                return [[_emit_row(b, qt, array_row(context, b, w_type, wv, row), array_row(context, b, mins_type, minsv, row),
                                  row_bytes, array_row(context, b, xq_type, xqv, t), array_row(context, b, dx_type, dxv, t),
                                  array_row(context, b, xsum_type, xsumv, t))]]
            emit_rows(context, b, first_v, last_v, (out_type, outv), colv, row_dot)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, mins, first, last, xq, dx, xsum, out, col), codegen


def for_token_passes(b, n_tokens, tokens_per_pass, body):
    """IR calling body(tokens) for every token below n_tokens (an i64 value): tokens_per_pass at a
    time (tokens: a list of that many i64 values), then what is left in at most one pass of each
    smaller power of two (7 tokens after passes of 8: 4, 2, 1), so that a short draft too is read
    once for several tokens. (tokens_per_pass: a power of two.)"""
    per_pass = ir.Constant(I64, tokens_per_pass)
    with cgutils.for_range(b, b.udiv(n_tokens, per_pass)) as passes:
        first = b.mul(passes.index, per_pass)
        body([b.add(first, ir.Constant(I64, j)) for j in range(tokens_per_pass)])
    done = b.sub(n_tokens, b.urem(n_tokens, per_pass))
    size = tokens_per_pass // 2
    while size:
        fits = b.icmp_unsigned(">=", b.sub(n_tokens, done), ir.Constant(I64, size))
        with b.if_then(fits):
            body([b.add(done, ir.Constant(I64, j)) for j in range(size)])
        done = b.select(fits, b.add(done, ir.Constant(I64, size)), done)
        size //= 2


def emit_rows(context, b, first, last, out, col, emit_row, tokens_per_pass=1, rows_per_pass=1):
    """IR calling emit_row(rows, tokens) for rows first..last-1 (i64 values) and every token t <
    len(out), tokens_per_pass tokens at a time (for_token_passes), storing the values it returns
    (per row of the list `rows`, one per token of the list `tokens`) at out[t, col + row - first];
    a group of rows at a time, so that a row is read from memory once for all tokens, and one
    group after the other, so that the rows stream from memory in order (AMD's prefetchers
    follow one stream, not four that each end after a row). A group is one row for a single
    token, and rows_per_pass rows for several (whose passes fetch ahead themselves): a token's
    value loaded once then serves every row of the group."""
    out_type, outv = out
    n_tokens = array_shape(context, b, out_type, outv)[0]

    def groups(start, count, size, per_pass):
        """Rows start.. in count groups of size rows."""
        with cgutils.for_range(b, count) as loop:
            at = b.add(start, b.mul(loop.index, ir.Constant(I64, size)))
            rows = [b.add(at, ir.Constant(I64, j)) for j in range(size)]

            def store(tokens):
                for row, values in zip(rows, emit_row(rows, tokens)):
                    for t, value in zip(tokens, values):
                        out_row = b.bitcast(array_row(context, b, out_type, outv, t), F32.as_pointer())
                        b.store(value, b.gep(out_row, [b.add(col, b.sub(row, first))]))
            for_token_passes(b, n_tokens, per_pass, store)

    n_rows = b.sub(last, first)
    if rows_per_pass == 1:
        groups(first, n_rows, 1, tokens_per_pass)
        return
    size = ir.Constant(I64, rows_per_pass)
    with b.if_else(b.icmp_unsigned(">", n_tokens, ir.Constant(I64, 1))) as (several, one):
        with several:
            whole = b.udiv(n_rows, size)
            groups(first, whole, rows_per_pass, tokens_per_pass)
            done = b.mul(whole, size)
            groups(b.add(first, done), b.sub(n_rows, done), 1, tokens_per_pass)
        with one:
            groups(first, n_rows, 1, 1)


def _emit_dequantize(b, qtype, row_ptr, row_bytes, out_ptr):
    """IR writing one row of qtype blocks as float32 at out_ptr: scale * value + bias per group."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    with cgutils.for_range(b, b.udiv(row_bytes, ir.Constant(I64, block_bytes))) as loop:
        position = b.mul(loop.index, ir.Constant(I64, block))
        blk = DECODERS[qtype](b, offset(b, row_ptr, b.mul(loop.index, ir.Constant(I64, block_bytes))))
        for grp, (scale, bias) in zip(blk.groups, blk.float_groups(b)):
            group_ints, signed = grp.integers(b)
            for ints in group_ints:
                n = ints.type.count
                values = to_float(b, ints, signed)
                weights = (b.fmul(values, splat(b, scale, n)) if bias is None
                           else mul_add(b, values, splat(b, scale, n), splat(b, bias, n)))
                target = b.gep(b.bitcast(out_ptr, F32.as_pointer()), [position])
                b.store(weights, b.bitcast(target, vector(F32, n).as_pointer()), align=4)
                position = b.add(position, ir.Constant(I64, n))


@intrinsic
def row_dequantize(typingctx, kinds, qtype, w, row, out, out_row):
    """out[out_row] = row `row` of the raw blocks w as float32, for a qtype of those the array
    kinds' dtype names (type_sets); callers guarantee the bounds."""
    qtypes = [t for t in tagged_types(kinds) if t in DECODERS]

    def codegen(context, b, signature, args):
        _, _, w_type, _, out_type, _ = signature.args
        _, qtype_v, wv, rowv, outv, out_rowv = args
        row_ptr, out_ptr = array_row(context, b, w_type, wv, rowv), array_row(context, b, out_type, outv, out_rowv)
        row_bytes = array_shape(context, b, w_type, wv)[1]
        switch_on_type(b, qtype_v, lambda qt: _emit_dequantize(b, qt, row_ptr, row_bytes, out_ptr), qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, row, out, out_row), codegen
