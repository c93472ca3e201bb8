"""Prefill's 8-bit products for the types that have no interleaved groups (the i-quants with
grids, the ternary types): eight rows at a time decoded once into a scratch group of plain
blocks, then interleaved.py's products over it for every token.

A row kernel (rowdot_int8.py) decodes each block again for every token, and a grid type's
decoding (grid rows gathered, signs applied) costs more than its products: prefill paid it per
token, or dequantized to float32 for BLAS. Here each block of the eight rows is decoded once
into a decoded block of theirs, interleaved as interleaved.py lays its groups out: each row's d
as float32, its 16 integer scales (one per 16 weights) as bytes, and its 256 integers plus 64
as unsigned bytes (every type's integers lie within +-62), so vpdpbusd takes them as they are
and the offset costs one product with the activations' group sums per block, as Q6_K's does.
The scratch group stays in L1/L2 while all the tokens pass over it.
"""
from gguf import GGML_QUANT_SIZES
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from gguf_io.quant_types import QUANT_TYPES

from .block_ir import DECODERS
from .cpu_features import int8_isa
from .interleaved import (GROUP, LAYOUTS, TOKENS_PER_PASS, _emit_groups, _group_sums, _i32s, _Kind, _scalar,
                          _sixteen_planes, _Unit, _words)
from .ir import F32, I8, I32, I64, array_data, array_row, array_shape, const_vector, offset, splat, vector
from .rowdot import for_token_passes, switch_on_type
from .type_sets import tagged_types

OFFSET = 64  # added to every integer: the largest of any type's is 62 (IQ3's grids)
SCALES_AT, VALUES_AT = 4, 20  # a row's decoded block: d (f32), 16 scales, 256 values
BLOCK_BYTES = VALUES_AT + 256


def _tile_types():
    """The types whose prefill decodes tiles: 8-bit products on Q8_K activations, no layout of
    interleaved groups."""
    return frozenset(t for t, q in QUANT_TYPES.items()
                     if t in DECODERS and t not in LAYOUTS and q.activations == "q8_k")


TILE_TYPES = _tile_types()


def decodes_in_tiles(qtype, n_rows: int) -> bool:
    """Whether prefill's products of a (n_rows, ...) matrix of qtype go through decoded tiles."""
    return qtype in TILE_TYPES and n_rows % GROUP == 0


class _Decoded(_Kind):
    """A scratch group's block: d, scales (byte g: group g's), 64 words of four values."""
    layout = [(0, 4)] + _words(SCALES_AT, 16, 1) + _words(VALUES_AT, 256, 4)
    sizes = (256, BLOCK_BYTES)
    top = 2 * OFFSET - 2
    steps = 4  # four groups of 16 a step

    @staticmethod
    def scales(b, blk, i, act):
        return b.fmul(blk.floats(0), splat(b, _scalar(b, act["d256"], i, F32), GROUP))

    @staticmethod
    def scale_table(b, blk):
        return [_i32s(b, scale) for scale in _sixteen_planes(b, blk, SCALES_AT)]

    @staticmethod
    def units(b, blk, step, scale):
        """Step s: groups 4s ... 4s + 3, whose words follow step 0's by 16 words a step."""
        ahead = b.mul(step, ir.Constant(I64, 16 * GROUP * 4))
        for j in range(4):
            first = b.add(b.mul(step, ir.Constant(I64, 64)), ir.Constant(I64, 16 * j))
            words = [(blk.bytes(VALUES_AT + 4 * (4 * j + q), 32, ahead), b.add(first, ir.Constant(I64, 4 * q)))
                     for q in range(4)]
            yield _Unit(words, 1, scale=scale(b.add(b.mul(step, ir.Constant(I64, 4)), ir.Constant(I64, j))))

    @staticmethod
    def correction(b, isa, blk, i, act):
        """The offset times each group's scale and activations' sum."""
        scales = [b.zext(s, vector(ir.IntType(16), GROUP)) for s in _sixteen_planes(b, blk, SCALES_AT)]
        return b.shl(_group_sums(b, isa, scales, act, i), const_vector(I32, [6] * GROUP))


def _store(b, value, ptr, at):
    b.store(value, b.bitcast(offset(b, ptr, at), value.type.as_pointer()), align=1)


@intrinsic
def decode_group(typingctx, kinds, qtype, w, first, out):
    """out (GROUP * BLOCK_BYTES bytes per block of a row) = rows first .. first + GROUP - 1 of the
    raw rows w (rows, bytes per row) of qtype, a type of TILE_TYPES of those the array kinds'
    dtype names, as one decoded group. Callers guarantee first + GROUP <= len(w) and out's size."""
    qtypes = [t for t in tagged_types(kinds) if t in TILE_TYPES]

    def codegen(context, b, signature, args):
        _, qtype_v, wv, first_v, outv = args
        w_type = signature.args[2]
        row_bytes = array_shape(context, b, w_type, wv)[1]
        out_ptr = array_data(context, b, signature.args[4], outv)
        values_tmp = b.bitcast(cgutils.alloca_once(b, vector(I8, 256)), I8.as_pointer())
        words_tmp = b.bitcast(values_tmp, I32.as_pointer())

        def emit(qt):
            block_bytes = GGML_QUANT_SIZES[qt][1]
            n_blocks = b.udiv(row_bytes, ir.Constant(I64, block_bytes))
            with cgutils.for_range(b, ir.Constant(I64, GROUP)) as lane_loop:
                lane = lane_loop.index
                row_ptr = array_row(context, b, w_type, wv, b.add(first_v, lane))
                with cgutils.for_range(b, n_blocks) as block_loop:
                    i = block_loop.index
                    blk = DECODERS[qt](b, offset(b, row_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
                    base = offset(b, out_ptr, b.mul(i, ir.Constant(I64, GROUP * BLOCK_BYTES)))
                    _store(b, blk.d, base, b.mul(lane, ir.Constant(I64, 4)))
                    n_scales = blk.scales.type.count
                    for g in range(16):
                        scale = b.extract_element(blk.scales, ir.Constant(I32, g * n_scales // 16))
                        _store(b, b.trunc(scale, I8), base, b.add(lane, ir.Constant(I64, GROUP * (SCALES_AT + g))))
                    at = 0
                    for v in (v for group in blk.groups for v in group.integers(b)[0]):
                        _store(b, b.add(v, const_vector(I8, [OFFSET] * v.type.count)), values_tmp, at)
                        at += v.type.count
                    for word in range(64):
                        at = b.add(b.mul(lane, ir.Constant(I64, 4)), ir.Constant(I64, GROUP * (VALUES_AT + 4 * word)))
                        _store(b, b.load(b.gep(words_tmp, [ir.Constant(I64, word)])), base, at)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, out), codegen


@intrinsic
def decoded_dot_int8(typingctx, group, q256, d256, sum16, out, col):
    """out[t, col .. col + GROUP - 1] = the decoded group's rows (decode_group's out) dotted with
    token t's Q8_K activations (activations.py), for every token t < len(out): TOKENS_PER_PASS at
    a time, as interleaved.groups_dot_int8 passes over a group."""
    isa = int8_isa()

    def codegen(context, b, signature, args):
        groupv, *act_values, outv, colv = args
        out_type = signature.args[4]
        n_tokens = array_shape(context, b, out_type, outv)[0]
        group_ptr = array_data(context, b, signature.args[0], groupv)
        n_blocks = b.udiv(array_shape(context, b, signature.args[0], groupv)[0], ir.Constant(I64, GROUP * BLOCK_BYTES))

        def store(tokens):
            acts = [{name: array_row(context, b, ty, v, t) for name, ty, v in
                     zip(("q256", "d256", "sum16"), signature.args[1:4], act_values)} for t in tokens]
            first_pass = b.icmp_unsigned("==", tokens[0], ir.Constant(I64, 0))
            values = _emit_groups(b, isa, _Decoded, _Decoded.layout, _Decoded.sizes, group_ptr, n_blocks, acts,
                                  first_pass)
            for t, value in zip(tokens, values):
                out_row = b.bitcast(array_row(context, b, out_type, outv, t), F32.as_pointer())
                b.store(value, b.bitcast(b.gep(out_row, [colv]), vector(F32, GROUP).as_pointer()), align=4)
        for_token_passes(b, n_tokens, TOKENS_PER_PASS, store)
        return context.get_dummy_value()
    return types.none(group, q256, d256, sum16, out, col), codegen
