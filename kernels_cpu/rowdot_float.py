"""Rows of F32, F16 and BF16 weights, kept as the file holds them: dot products with float32
activations (rows_dot_float) and conversion to float32 (row_float32).

Each weight is widened to float32 in registers (vcvtph2ps for F16, a 16-bit shift for BF16) and
multiplied exactly, so decode reads two bytes per weight where a float32 copy of the matrix would
take four (llama.cpp reads two too, and rounds the activations to F16 or BF16 besides). A few tokens
(a verified draft) take TOKENS_PER_PASS at a time over each row, which is read from memory once.
"""
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .ir import (F32, I8, I16, I32, I64, LANES, array_row, array_shape, fused_mul_add, horizontal_sum,
                 lanes_below, load_vector, masked_load, offset, prefetch_weights, vector)
from .cpu_features import target_features
from .rowdot import emit_rows, switch_on_type
from .type_sets import tagged_types

# GGUF's float types and their bytes per weight
FLOAT_BYTES = {T.F32: 4, T.F16: 2, T.BF16: 2}
# Independent accumulator chains a token, so that consecutive multiply-adds need not wait for one
# another (decode is bound by reading the weights: two chains outrun it).
ACCUMULATORS = 2
# Several tokens (a verified draft) go over a group of rows at a time, ROWS_PER_PASS rows by
# TOKENS_PER_PASS tokens, each weight widened once for all the tokens and each token's values
# loaded once for all the rows: with AVX-512's 32 registers, 2 rows by 4 tokens (16 chains) load
# 6 vectors a 16 multiply-adds where one row by 8 tokens would load 18 (the loads, more than the
# multiply-adds, bound a pass from cache), and more rows or tokens a pass would spill the chains.
# AVX2's 16 registers hold one row by two tokens' chains of 16-lane vectors.
TOKENS_PER_PASS = 4 if "avx512f" in target_features() else 2
ROWS_PER_PASS = 2 if "avx512f" in target_features() else 1
# The first pass over a row, if it takes 2 tokens or more, asks for the row's lines
# ir.PASS_PREFETCH_BYTES ahead, into L2 (ir.prefetch_weights): with the hardware prefetchers
# alone, or with one token's fetches into L1, its arithmetic and its reads take turns, so that a
# pass costs about the read plus the arithmetic. One token keeps up with memory without them.


def _as_float32(b, qtype, raw):
    """<n x float> from n raw values of qtype (<n x float>, <n x half> or <n x i16>)."""
    n = raw.type.count
    if qtype == T.F32:
        return raw
    if qtype == T.F16:
        return b.fpext(raw, vector(F32, n))
    return b.bitcast(b.shl(b.zext(raw, vector(I32, n)), ir.Constant(vector(I32, n), [16] * n)), vector(F32, n))


def _element(qtype):
    return {T.F32: F32, T.F16: ir.HalfType(), T.BF16: I16}[qtype]


def _load(b, qtype, ptr, at, mask=None):
    """LANES weights of a row at ptr from weight `at` (an i64 value) as float32; with mask, the
    masked lanes alone are read (zeros elsewhere)."""
    element = _element(qtype)
    at_ptr = b.bitcast(b.gep(b.bitcast(ptr, element.as_pointer()), [at]), vector(element, LANES).as_pointer())
    if mask is None:
        return _as_float32(b, qtype, b.load(at_ptr, align=FLOAT_BYTES[qtype]))
    return _as_float32(b, qtype, masked_load(b, at_ptr, mask, FLOAT_BYTES[qtype]))


def _load_x(b, x_ptr, at, mask=None):
    if mask is None:
        return load_vector(b, x_ptr, at, F32)
    at_ptr = b.bitcast(b.gep(b.bitcast(x_ptr, F32.as_pointer()), [at]), vector(F32, LANES).as_pointer())
    return masked_load(b, at_ptr, mask, 4)


def _emit_rows(b, qtype, row_ptrs, x_ptrs, k, from_memory):
    """IR for rows of k weights (row_ptrs) each dotted with each token's x (x_ptrs), as float32
    sums per row, per token: per row and token, ACCUMULATORS chains of LANES lanes over whole
    steps, then single vectors, then a masked tail. Each weight vector is loaded and widened once
    for all the tokens, and each token's vector once for all the rows; a row's sum for a token is
    the same operations however many rows and tokens come with it, in an order LLVM may not
    change (no fast-math regrouping), so it is bit for bit the same. from_memory (an i1 value):
    this is the first pass over the rows."""
    zero = ir.Constant(vector(F32, LANES), [0.0] * LANES)
    accs = [[[cgutils.alloca_once_value(b, zero) for _ in range(ACCUMULATORS)] for _ in x_ptrs] for _ in row_ptrs]
    step = ACCUMULATORS * LANES

    def add(chain, at, mask=None):
        ws = [_load(b, qtype, row_ptr, at, mask) for row_ptr in row_ptrs]
        for t, x_ptr in enumerate(x_ptrs):
            x = _load_x(b, x_ptr, at, mask)
            for w, row_accs in zip(ws, accs):
                acc = row_accs[t][chain]
                b.store(fused_mul_add(b, w, x, b.load(acc)), acc)

    steps = b.udiv(k, ir.Constant(I64, step))
    with cgutils.for_range(b, steps) as loop:
        first = b.mul(loop.index, ir.Constant(I64, step))
        if len(x_ptrs) > 1:  # (see the fetches' note above _as_float32)
            with b.if_then(from_memory):
                for row_ptr in row_ptrs:
                    ahead = offset(b, b.bitcast(row_ptr, I8.as_pointer()),
                                   b.mul(first, ir.Constant(I64, FLOAT_BYTES[qtype])))
                    for line in range(0, step * FLOAT_BYTES[qtype], 64):
                        prefetch_weights(b, offset(b, ahead, line), len(x_ptrs))
        for j in range(ACCUMULATORS):
            add(j, b.add(first, ir.Constant(I64, j * LANES)))
    done = b.mul(steps, ir.Constant(I64, step))
    with cgutils.for_range(b, b.udiv(b.sub(k, done), ir.Constant(I64, LANES))) as loop:
        add(0, b.add(done, b.mul(loop.index, ir.Constant(I64, LANES))))
    whole = b.sub(k, b.urem(k, ir.Constant(I64, LANES)))
    add(ACCUMULATORS - 1, whole, lanes_below(b, b.sub(k, whole)))  # (no lanes when k is a multiple of LANES)
    sums = []
    for row_accs in accs:
        sums.append([])
        for acc in row_accs:
            total = b.load(acc[0])
            for chain in acc[1:]:
                total = b.fadd(total, b.load(chain))
            sums[-1].append(horizontal_sum(b, total, flags=()))
    return sums


def _float_types(kinds):
    return [t for t in tagged_types(kinds) if t in FLOAT_BYTES]


@intrinsic
def rows_dot_float(typingctx, kinds, qtype, w, first, last, x, out, col):
    """out[t, col + r - first] = row r of w (rows, bytes per row: a float type's raw rows) dotted
    with x[t] (float32, as long as a row), for rows first <= r < last and every token t <
    len(out). Callers guarantee last <= len(w), x as long as a row for every token of out,
    col + last - first <= out.shape[1], and a qtype of FLOAT_BYTES that the array kinds' dtype
    names (type_sets)."""
    qtypes = _float_types(kinds)

    def codegen(context, b, signature, args):
        _, _, w_type, _, _, x_type, out_type, _ = signature.args
        _, qtype_v, wv, first_v, last_v, xv, outv, colv = args
        k = array_shape(context, b, x_type, xv)[1]

        def emit(qt):
            def row_dot(rows, tokens):
                return _emit_rows(b, qt, [array_row(context, b, w_type, wv, row) for row in rows],
                                  [array_row(context, b, x_type, xv, t) for t in tokens], k,
                                  b.icmp_unsigned("==", tokens[0], ir.Constant(I64, 0)))
            emit_rows(context, b, first_v, last_v, (out_type, outv), colv, row_dot, TOKENS_PER_PASS, ROWS_PER_PASS)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, last, x, out, col), codegen


@intrinsic
def row_float32(typingctx, kinds, qtype, w, row, out, out_row):
    """out[out_row] = row `row` of w (a float type's raw rows) as float32, for a qtype of
    FLOAT_BYTES that the array kinds' dtype names; callers guarantee the bounds."""
    qtypes = _float_types(kinds)

    def codegen(context, b, signature, args):
        _, _, w_type, _, out_type, _ = signature.args
        _, qtype_v, wv, rowv, outv, out_rowv = args
        row_ptr, out_ptr = array_row(context, b, w_type, wv, rowv), array_row(context, b, out_type, outv, out_rowv)
        k = array_shape(context, b, out_type, outv)[1]

        def emit(qt):
            out_f32 = b.bitcast(out_ptr, F32.as_pointer())
            whole = b.udiv(k, ir.Constant(I64, LANES))
            with cgutils.for_range(b, whole) as loop:
                at = b.mul(loop.index, ir.Constant(I64, LANES))
                target = b.bitcast(b.gep(out_f32, [at]), vector(F32, LANES).as_pointer())
                b.store(_load(b, qt, row_ptr, at), target, align=4)
            with cgutils.for_range(b, b.urem(k, ir.Constant(I64, LANES))) as loop:  # the tail, one by one
                at = b.add(b.mul(whole, ir.Constant(I64, LANES)), loop.index)
                element = _element(qt)
                raw = b.load(b.gep(b.bitcast(row_ptr, element.as_pointer()), [at]))
                one = b.insert_element(ir.Constant(vector(element, 1), ir.Undefined), raw, ir.Constant(I32, 0))
                b.store(b.extract_element(_as_float32(b, qt, one), ir.Constant(I32, 0)), b.gep(out_f32, [at]))
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, row, out, out_row), codegen
