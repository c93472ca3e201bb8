"""Prefill's 8-bit products for the types that have no interleaved groups (the i-quants with
grids, the ternary types): eight rows at a time decoded once into a scratch group, then every
band of 16 tokens passes over it with the tokens in the vector lanes.

A row kernel (rowdot_int8.py) decodes each block again for every token, and a grid type's
decoding (grid rows gathered, signs applied) costs more than its products: prefill paid it per
token, or dequantized to float32 for BLAS. Here each block of the eight rows is decoded once
(decode_group): the rows' d as float32, each unit's integer scale (a unit: the weights that share
one, 16 or 32 by type) as int32, each row's integers as signed bytes (every type's lie within
+-62), and per row the part of the products that the activations' offset adds (below). The
scratch group stays in L1/L2 while the bands pass over it.

A band (activation_bands) holds 16 tokens' activations, four bytes of each to a 32-bit lane, plus
128 as unsigned bytes. One vpdpbusd then multiplies four weights of a row (one broadcast load,
folded into the instruction on AVX-512) by the same four columns of the 16 tokens: 64 products,
and a unit's scale is one multiply for 16 tokens, where with the rows in the lanes (eight rows
and one token a vector, as interleaved.py's products) it takes one per token (llama.cpp b11434's
tiled matmul puts the tokens in the lanes too, ggml-cpu/tiled). The offset
adds 128 times each row's scaled weight sums, which depend on the weights alone: decode_group
keeps it for each row and block, taken off each block's total once.

A token's products are the same integers and float operations (the block's integer total, times
d times the token's d, added block by block) whichever band and lane it takes, so its result
does not depend on the tokens beside it.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from gguf_io.quant_types import QUANT_TYPES

from .block_ir import DECODERS
from .cpu_features import int8_isa, target_features
from .interleaved import GROUP, KINDS, LAYOUTS, Block
from .ir import (F32, I8, I32, I64, array_data, array_row, array_shape, byte_quad_sums, const_vector, offset,
                 splat, vector, wide_byte_quad_sums)
from .rowdot import switch_on_type
from .type_sets import tagged_types

TOKENS = 16  # a band's tokens: one int32 lane each of a 512-bit vector
ACTIVATION_OFFSET = 128  # added to the activations (0x80 flipped): vpdpbusd takes them as unsigned bytes
# a group's decoded block of 256 weights: d (f32), offset's part (i32), scales (i32, unit-major,
# room for 16), then each row's 256 integers (the products broadcast a row's four at a time, so
# the rows need no interleaving)
D_AT, OFFSET_PART_AT, SCALES_AT = 0, 4 * GROUP, 8 * GROUP
VALUES_AT = SCALES_AT + 4 * GROUP * 16
BLOCK_BYTES = VALUES_AT + GROUP * 256


def _tile_types():
    """The types whose prefill decodes tiles: 8-bit products on Q8_K activations, no layout of
    interleaved groups."""
    return frozenset(t for t, q in QUANT_TYPES.items()
                     if t in DECODERS and t not in LAYOUTS and q.activations == "q8_k")


TILE_TYPES = _tile_types()


# The interleaved types whose groups prefill decodes for the bands where the CPU has VNNI: signed
# integers, a float16 d at the front of a block of 256, an integer scale a unit, no mins (the
# other kinds keep their products with the rows in the lanes; and AVX2's vpmaddubsw would
# saturate on these integers, up to 127).
GROUP_TYPES = frozenset({T.IQ4_XS})


def _scale_unit(qtype) -> int:
    """How many weights of qtype's blocks share an integer scale, as its decoder (or its kind's
    scale table) gives them."""
    probe = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [I8.as_pointer()]), "probe")
    b = ir.IRBuilder(probe.append_basic_block())
    if qtype in GROUP_TYPES:
        return 256 // len(KINDS[qtype].scale_table(b, Block(b, LAYOUTS[qtype], probe.args[0])))
    return 256 // DECODERS[qtype](b, probe.args[0]).scales.type.count


# (a band's products multiply once per unit: the types with a scale per 32 weights take half the
# multiplies of those with one per 16)
UNITS = {qtype: _scale_unit(qtype) for qtype in TILE_TYPES | GROUP_TYPES}


def decodes_in_tiles(qtype, n_rows: int) -> bool:
    """Whether prefill's products of a (n_rows, ...) matrix of qtype go through decoded tiles."""
    return qtype in TILE_TYPES and n_rows % GROUP == 0


def decodes_groups(qtype) -> bool:
    """Whether prefill's products of a matrix of qtype in interleaved groups decode them for the
    bands."""
    return qtype in GROUP_TYPES and int8_isa() == "vnni"


def _word_at(b, qtype, word, row):
    """Where word `word` (an i64 value: four weights) of row `row` lies in a decoded block: the
    rows one after the other for the types decoded from rows, the eight rows' words side by side
    for those decoded from interleaved groups (as their units give them)."""
    if qtype in GROUP_TYPES:
        return b.add(b.mul(word, ir.Constant(I64, 4 * GROUP)), ir.Constant(I64, VALUES_AT + 4 * row))
    return b.add(b.mul(word, ir.Constant(I64, 4)), ir.Constant(I64, VALUES_AT + 256 * row))


@njit(cache=True, nogil=True)
def activation_bands(q256, d256):
    """Q8_K activations (activations.py: q256 (T, K) int8, d256 (T, K / 256)) as bands of TOKENS
    tokens: (bands, K * TOKENS) uint8, word w of a band's token j at 4 * (TOKENS * w + j), plus
    ACTIVATION_OFFSET; and (bands, K / 256 * TOKENS) float32, block i's d of token j at
    TOKENS * i + j. The last band's missing tokens have zero activations and d."""
    n, k = q256.shape
    n_bands = (n + TOKENS - 1) // TOKENS
    flip = np.uint32(0x80808080)
    bq = np.full((n_bands, k // 4 * TOKENS), flip, dtype=np.uint32)
    bd = np.zeros((n_bands, d256.shape[1] * TOKENS), dtype=np.float32)
    words = q256.view(np.uint32)
    for band in range(n_bands):  # (written in order: a band's words of one token apart spill L1)
        lanes = min(TOKENS, n - band * TOKENS)
        for w in range(k // 4):
            for lane in range(lanes):
                bq[band, TOKENS * w + lane] = words[band * TOKENS + lane, w] ^ flip
        for i in range(d256.shape[1]):
            for lane in range(lanes):
                bd[band, TOKENS * i + lane] = d256[band * TOKENS + lane, i]
    return bq.view(np.uint8), bd


def _pointer(b, base, at, element):
    return b.bitcast(offset(b, base, at), element.as_pointer())


def _store(b, value, base, at):
    b.store(value, _pointer(b, base, at, value.type), align=1)


def _as_i32(b, value):
    width = value.type.width
    return value if width == 32 else b.sext(value, I32) if width < 32 else b.trunc(value, I32)


def _offset_part(b, isa, values, scales, unit):
    """ACTIVATION_OFFSET times a row's block of integers (at values) dotted with each weight's
    scale (the byte scales are at most 31): eight 32-byte products with the scales repeated."""
    sums = ir.Constant(vector(I32, 8), [0] * 8)
    repeated = [splat(b, b.trunc(scale, I8), unit) for scale in scales]
    for c in range(8):
        factors = repeated[c] if unit == 32 else b.shuffle_vector(repeated[2 * c], repeated[2 * c + 1],
                                                                  const_vector(I32, range(32)))
        sums = byte_quad_sums(b, isa, sums, factors, b.load(_pointer(b, values, 32 * c, vector(I8, 32)), align=1))
    total = b.call(cgutils.get_or_insert_function(b.module, ir.FunctionType(I32, [sums.type]),
                                                  "llvm.vector.reduce.add.v8i32"), [sums])
    return b.mul(total, ir.Constant(I32, ACTIVATION_OFFSET))


def _decode_rows(context, b, signature, args, isa, qt):
    """decode_group's IR for a type of TILE_TYPES: row by row through its decoder."""
    _, _, wv, first_v, outv = args
    w_type = signature.args[2]
    out_ptr = array_data(context, b, signature.args[4], outv)
    unit, block_bytes = UNITS[qt], GGML_QUANT_SIZES[qt][1]
    n_blocks = b.udiv(array_shape(context, b, w_type, wv)[1], ir.Constant(I64, block_bytes))
    with cgutils.for_range(b, ir.Constant(I64, GROUP)) as lane_loop:
        lane = lane_loop.index
        lane_at = b.mul(lane, ir.Constant(I64, 4))
        row_ptr = array_row(context, b, w_type, wv, b.add(first_v, lane))
        with cgutils.for_range(b, n_blocks) as block_loop:
            i = block_loop.index
            blk = DECODERS[qt](b, offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
            base = offset(b, out_ptr, b.mul(i, ir.Constant(I64, BLOCK_BYTES)))
            _store(b, blk.d, base, b.add(lane_at, ir.Constant(I64, D_AT)))
            values = offset(b, base, b.add(b.mul(lane, ir.Constant(I64, 256)), ir.Constant(I64, VALUES_AT)))
            at = 0
            for v in (v for group in blk.groups for v in group.integers(b)[0]):
                _store(b, v, values, at)
                at += v.type.count
            scales = [b.extract_element(blk.scales, ir.Constant(I32, u)) for u in range(256 // unit)]
            for u, scale in enumerate(scales):
                _store(b, _as_i32(b, scale), base, b.add(lane_at, ir.Constant(I64, SCALES_AT + 4 * GROUP * u)))
            part = _offset_part(b, isa, values, scales, unit)
            _store(b, part, base, b.add(lane_at, ir.Constant(I64, OFFSET_PART_AT)))


def _decode_groups(context, b, signature, args, isa, qt):
    """decode_group's IR for a type of GROUP_TYPES: eight rows at once through its kind's units
    (interleaved.py), their words stored as they come."""
    _, _, wv, first_v, outv = args
    w_type = signature.args[2]
    out_ptr = array_data(context, b, signature.args[4], outv)
    kind, block_bytes = KINDS[qt], GROUP * GGML_QUANT_SIZES[qt][1]
    n_blocks = b.udiv(array_shape(context, b, w_type, wv)[1], ir.Constant(I64, block_bytes))
    group_ptr = array_row(context, b, w_type, wv, b.udiv(first_v, ir.Constant(I64, GROUP)))
    ints = vector(I32, GROUP)
    scales = cgutils.alloca_once(b, ints, size=256 // UNITS[qt])
    part = cgutils.alloca_once(b, ints)
    ones = ir.Constant(vector(I8, 4 * GROUP), [1] * 4 * GROUP)
    with cgutils.for_range(b, n_blocks) as block_loop:
        i = block_loop.index
        blk = Block(b, LAYOUTS[qt], offset(b, group_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
        base = offset(b, out_ptr, b.mul(i, ir.Constant(I64, BLOCK_BYTES)))
        _store(b, blk.halves(0), base, ir.Constant(I64, D_AT))
        for u, scale in enumerate(kind.scale_table(b, blk)):
            b.store(scale, b.gep(scales, [ir.Constant(I64, u)]))
            _store(b, scale, base, ir.Constant(I64, SCALES_AT + 4 * GROUP * u))
        b.store(ir.Constant(ints, [0] * GROUP), part)
        with cgutils.for_range(b, ir.Constant(I64, kind.steps)) as step:
            for unit in kind.units(b, blk, step.index, lambda j: b.load(b.gep(scales, [j]))):
                sums = ir.Constant(ints, [0] * GROUP)
                for values, first in unit.words:
                    first = ir.Constant(I64, first) if isinstance(first, int) else first
                    _store(b, values, base, _word_at(b, qt, b.udiv(first, ir.Constant(I64, 4)), 0))
                    sums = byte_quad_sums(b, isa, sums, ones, values)
                b.store(b.add(b.load(part), b.mul(sums, unit.scale)), part)
        _store(b, b.mul(b.load(part), splat(b, ir.Constant(I32, ACTIVATION_OFFSET), GROUP)), base,
               ir.Constant(I64, OFFSET_PART_AT))


@intrinsic
def decode_group(typingctx, kinds, qtype, w, first, out):
    """out (BLOCK_BYTES per block of a row) = rows first .. first + GROUP - 1 (a multiple of GROUP
    for a type of GROUP_TYPES) of a matrix of qtype as one decoded group: w its raw rows (rows,
    bytes per row) for a type of TILE_TYPES, its interleaved groups (rows / GROUP, bytes) for one
    of GROUP_TYPES, a type of those the array kinds' dtype names. Callers guarantee first + GROUP
    rows and out's size."""
    qtypes, isa = [t for t in tagged_types(kinds) if t in UNITS], int8_isa()

    def codegen(context, b, signature, args):
        def emit(qt):
            (_decode_groups if qt in GROUP_TYPES else _decode_rows)(context, b, signature, args, isa, qt)
        switch_on_type(b, args[1], emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, out), codegen


@intrinsic
def decoded_band_product(typingctx, kinds, qtype, group, bq, bd, out, first_token, col):
    """out[first_token + j, col .. col + GROUP - 1] = the decoded group's rows (decode_group's out,
    of qtype, a type of TILE_TYPES or GROUP_TYPES of those the array kinds' dtype names) dotted
    with token j of a band (activation_bands's bq and bd rows), for the band's tokens below
    len(out). Callers guarantee col + GROUP <= out.shape[1] and first_token < len(out)."""
    isa, wide = int8_isa(), "avx512vnni" in target_features()
    qtypes = [t for t in tagged_types(kinds) if t in UNITS]

    def codegen(context, b, signature, args):
        _, qtype_v, groupv, bqv, bdv, outv, first_v, colv = args
        out_type = signature.args[5]
        group_ptr = array_data(context, b, signature.args[2], groupv)
        act_ptr = array_data(context, b, signature.args[3], bqv)
        d_ptr = array_data(context, b, signature.args[4], bdv)
        n_blocks = b.udiv(array_shape(context, b, signature.args[4], bdv)[0], ir.Constant(I64, TOKENS))
        ints, floats = vector(I32, TOKENS), vector(F32, TOKENS)
        zero_i, zero_f = ir.Constant(ints, [0] * TOKENS), ir.Constant(floats, [0.0] * TOKENS)
        accs = [cgutils.alloca_once_value(b, zero_f) for _ in range(GROUP)]
        totals = [cgutils.alloca_once(b, ints) for _ in range(GROUP)]

        def scalar(blk, at, element):
            return b.load(_pointer(b, blk, at, element), align=4)

        def units(blk, acts, qt):
            """Each row's integer total over the block: a unit's products times its scale."""
            unit = UNITS[qt]
            for total in totals:
                b.store(zero_i, total)
            with cgutils.for_range(b, ir.Constant(I64, 256 // unit)) as unit_loop:
                u = unit_loop.index
                words_at = b.mul(u, ir.Constant(I64, unit // 4))
                words = [b.add(words_at, ir.Constant(I64, j)) for j in range(unit // 4)]
                xs = [b.load(_pointer(b, acts, b.mul(word, ir.Constant(I64, 4 * TOKENS)), vector(I8, 4 * TOKENS)),
                             align=1) for word in words]
                for r, total in enumerate(totals):
                    sums = zero_i
                    for word, x in zip(words, xs):
                        weights = b.bitcast(splat(b, scalar(blk, _word_at(b, qt, word, r), I32), TOKENS),
                                            vector(I8, 4 * TOKENS))
                        sums = wide_byte_quad_sums(b, isa, sums, x, weights, wide)
                    scale_at = b.add(b.mul(u, ir.Constant(I64, 4 * GROUP)), ir.Constant(I64, SCALES_AT + 4 * r))
                    scale = splat(b, scalar(blk, scale_at, I32), TOKENS)
                    b.store(b.add(b.load(total), b.mul(sums, scale)), total)

        def emit(qt):
            with cgutils.for_range(b, n_blocks) as block_loop:
                i = block_loop.index
                blk = offset(b, group_ptr, b.mul(i, ir.Constant(I64, BLOCK_BYTES)))
                units(blk, offset(b, act_ptr, b.mul(i, ir.Constant(I64, 256 * TOKENS))), qt)
                token_d = b.load(_pointer(b, d_ptr, b.mul(i, ir.Constant(I64, 4 * TOKENS)), floats), align=4)
                for r, (acc, total) in enumerate(zip(accs, totals)):
                    part = splat(b, scalar(blk, ir.Constant(I64, OFFSET_PART_AT + 4 * r), I32), TOKENS)
                    row_d = splat(b, scalar(blk, ir.Constant(I64, D_AT + 4 * r), F32), TOKENS)
                    # (a one-token pass's float operations in its order: total * (d * token's d), added on)
                    value = b.fmul(b.sitofp(b.sub(b.load(total), part), floats), b.fmul(row_d, token_d))
                    b.store(b.fadd(b.load(acc), value), acc)
        switch_on_type(b, qtype_v, emit, qtypes)
        n_tokens = array_shape(context, b, out_type, outv)[0]
        left = b.sub(n_tokens, first_v)
        count = b.select(b.icmp_signed("<", left, ir.Constant(I64, TOKENS)), left, ir.Constant(I64, TOKENS))
        lanes = cgutils.alloca_once(b, floats, size=GROUP)
        for r, acc in enumerate(accs):
            b.store(b.load(acc), b.gep(lanes, [ir.Constant(I64, r)]))
        lane_floats = b.bitcast(lanes, F32.as_pointer())
        with cgutils.for_range(b, count) as token_loop:
            j = token_loop.index
            out_row = b.bitcast(array_row(context, b, out_type, outv, b.add(first_v, j)), F32.as_pointer())
            for r in range(GROUP):
                value = b.load(b.gep(lane_floats, [b.add(ir.Constant(I64, TOKENS * r), j)]))
                b.store(value, b.gep(out_row, [b.add(colv, ir.Constant(I64, r))]))
        return context.get_dummy_value()
    return types.none(kinds, qtype, group, bq, bd, out, first_token, col), codegen
