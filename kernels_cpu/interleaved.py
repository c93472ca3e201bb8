"""Eight rows of a matrix interleaved so that one vector holds the same weights of all of them:
decode's 8-bit products then keep one row per vector lane, as llama.cpp's repacked types do
(ggml_gemv_q4_K_8x8_q8_K and its kin, b11434).

A one-row product spends most of its instructions applying each unit's scale: a 32-weight unit's
products land in 16 lanes that all need that one scale (a Q4_K super-block took ~78 vector
instructions, ~20 cycles in llvm-mca's Zen 3 model), and every row ends in a horizontal sum.
With eight rows side by side, a 32-bit lane holds four weights of one row, vpdpbusd multiplies
them by the same four activations (one broadcast load) in every lane, and a group's scales are
one vector of the eight rows' scales: one multiply for all of them.

A group of GROUP rows keeps each block's bytes, rearranged: the block is cut into pieces (a scale,
four bytes of quants, ...; LAYOUTS), and each piece becomes that piece of the eight rows' blocks
side by side. So an interleaved block takes what the eight rows' blocks take in the file, and the
bit operations that decode one row's bytes decode eight rows' in the same instructions. The
rows are rearranged once, when the model loads, into a copy that replaces the mapped file's rows
(as llama.cpp's repacking does): prefill and embeddings read rows back out of the groups
(row_blocks). The precise path (16-bit activations) keeps the file's rows.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .cpu_features import int8_isa
from .rowdot import switch_on_type
from .threads import in_parallel
from .type_sets import tagged_types
from .ir import (F32, FAST, I8, I16, I32, I64, array_row, array_shape, byte_quad_sums, const_vector, load_bytes,
                 load_vector, mul_add, offset, signed_byte_quad_sums, splat, vector)

GROUP = 8  # rows per group: a 256-bit register of int32 or float32


def _words(at, size, width):
    """The pieces of `width` bytes of the block's bytes at .. at + size."""
    return [(at + j, width) for j in range(0, size, width)]


# Each interleaved type's block as (byte offset, size) pieces of the file's block, in the order
# the interleaved block holds them, each as that piece of rows 0-7: the order the products read
# them in, so that a group streams from memory front to back (Q6_K read its ql halves and qh as
# three sub-streams of each block at first, and ran at a third of the speed from memory).
LAYOUTS = {
    T.Q4_0: [(0, 2)] + _words(2, 16, 4),                                     # d, qs
    T.Q8_0: [(0, 2)] + _words(2, 32, 4),                                     # d, qs
    T.Q4_K: [(0, 2), (2, 2)] + _words(4, 12, 1) + _words(16, 128, 4),       # d, dmin, scales, qs
    T.Q6_K: [(208, 2)] + _words(192, 16, 1) + [                             # d, scales, then per word:
        piece for h in range(2) for w in range(8)                           # ql (two), qh
        for piece in ((64 * h + 4 * w, 4), (64 * h + 32 + 4 * w, 4), (128 + 32 * h + 4 * w, 4))],
}


def interleaves(qtype, n_rows: int) -> bool:
    """Whether a (n_rows, ...) matrix of qtype can be held in groups of interleaved rows."""
    return qtype in LAYOUTS and n_rows % GROUP == 0


def byte_places(qtype) -> np.ndarray:
    """(2, block bytes) int64: where byte c of a row's block lies in its group's interleaved
    block, for the row in lane 0 ([0, c]), and how far each lane moves it ([1, c])."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    places = np.empty((2, block_bytes), dtype=np.int64)
    at = 0
    for first, size in LAYOUTS[qtype]:
        places[0, first:first + size] = at + np.arange(size)
        places[1, first:first + size] = size
        at += GROUP * size
    return places


@njit(cache=True, nogil=True)
def _interleave(raw, places, out, first_group, last_group):
    block_bytes = places.shape[1]
    n_blocks = raw.shape[1] // block_bytes
    for g in range(first_group, last_group):
        for lane in range(GROUP):
            row = raw[GROUP * g + lane]
            for i in range(n_blocks):
                group_block = out[g, i * GROUP * block_bytes:(i + 1) * GROUP * block_bytes]
                for c in range(block_bytes):
                    group_block[places[0, c] + lane * places[1, c]] = row[i * block_bytes + c]


@njit(cache=True, nogil=True)
def row_blocks(groups, places, row, out):
    """out = row `row` of a matrix in interleaved groups, as the file lays it out."""
    block_bytes = places.shape[1]
    g, lane = row // GROUP, row % GROUP
    for i in range(out.shape[0] // block_bytes):
        group_block = groups[g, i * GROUP * block_bytes:(i + 1) * GROUP * block_bytes]
        for c in range(block_bytes):
            out[i * block_bytes + c] = group_block[places[0, c] + lane * places[1, c]]


def interleave(qtype, raw: np.ndarray) -> np.ndarray:
    """The rows of raw (rows, bytes per row) in interleaved groups: (rows / GROUP, bytes per row *
    GROUP), on all threads (threads.py's: a kernel of Numba's parallel loops took ~1 s of the first
    run to compile)."""
    out = np.empty((raw.shape[0] // GROUP, raw.shape[1] * GROUP), dtype=np.uint8)
    places = byte_places(qtype)
    in_parallel(lambda first, last: _interleave(raw, places, out, first, last), out.shape[0], max_tile=4096)
    return out


class _Block:
    """One interleaved block at `ptr`: its pieces for all GROUP rows."""

    def __init__(self, b, qtype, ptr):
        self.b, self.ptr, self.starts = b, ptr, {}
        at = 0
        for first, size in LAYOUTS[qtype]:
            self.starts[first] = at
            at += GROUP * size

    def bytes(self, first, n):
        """n bytes of the interleaved block from the piece at byte `first` of a file block:
        <n x i8> (that piece of rows 0-7, and what follows)."""
        return load_bytes(self.b, self.ptr, self.starts[first], n)

    def halves(self, first):
        """A float16 of every row (the piece at byte `first`) as <8 x float>."""
        at = self.b.bitcast(offset(self.b, self.ptr, self.starts[first]), vector(ir.HalfType(), GROUP).as_pointer())
        return self.b.fpext(self.b.load(at, align=1), vector(F32, GROUP))


def _bytes_op(op):
    def apply(b, v, k):
        return op(b, v, const_vector(I8, [k] * v.type.count))
    return apply


_and = _bytes_op(lambda b, v, c: b.and_(v, c))
_shr = _bytes_op(lambda b, v, c: b.lshr(v, c))
_shl = _bytes_op(lambda b, v, c: b.shl(v, c))


def _i32s(b, values, signed=False):
    """<8 x i8> -> <8 x i32>."""
    return (b.sext if signed else b.zext)(values, vector(I32, GROUP))


def _plane(b, planes, k):
    """Plane k (eight bytes: one per row) of a vector of planes."""
    return b.shuffle_vector(planes, planes, const_vector(I32, range(GROUP * k, GROUP * k + GROUP)))


def _four(b, act_q, at):
    """Activations at .. at + 3 (an i64 value) broadcast to every 32-bit lane: <32 x i8>."""
    four = b.load(b.bitcast(b.gep(b.bitcast(act_q, I8.as_pointer()), [at]), I32.as_pointer()), align=1)
    return b.bitcast(splat(b, four, GROUP), vector(I8, 4 * GROUP))


def _scalar(b, array, i, element):
    return b.load(b.gep(b.bitcast(array, element.as_pointer()), [i]))


def _sum(b, values):
    while len(values) > 1:
        values = [b.add(values[j], values[j + 1]) if j + 1 < len(values) else values[j]
                  for j in range(0, len(values), 2)]
    return values[0]


def _zero_i32():
    return ir.Constant(vector(I32, GROUP), [0] * GROUP)


# Each type's block i: ((integer sums of the eight rows, float scale to multiply them by), the
# same for what its mins subtract, or None). Their multiply-adds run in chains of at most four
# (each waits ~5 cycles for the one before): in chains of eight, Q4_K read 17-22 GB/s from
# memory where it reads 25-30 with two chains per unit (2 threads, AMD EPYC).

def _q4_0(b, isa, blk, i, act):  # d, qs: byte j holds weight j (low nibble) and j + 16, offset 8
    first = b.mul(i, ir.Constant(I64, 32))
    chains = [_zero_i32()] * 2
    for w in range(4):
        q = blk.bytes(2 + 4 * w, 32)
        for chain, values, at in ((0, _and(b, q, 15), 4 * w), (1, _shr(b, q, 4), 16 + 4 * w)):
            x = _four(b, act["q32"], b.add(first, ir.Constant(I64, at)))
            chains[chain] = byte_quad_sums(b, isa, chains[chain], values, x)
    acc = b.add(*chains)
    offset_sum = b.mul(_scalar(b, act["sum32"], i, I32), ir.Constant(I32, 8))
    acc = b.sub(acc, splat(b, offset_sum, GROUP))
    return (acc, b.fmul(blk.halves(0), splat(b, _scalar(b, act["d32"], i, F32), GROUP), flags=FAST)), None


def _q8_0(b, isa, blk, i, act):  # d, qs: signed
    first = b.mul(i, ir.Constant(I64, 32))
    chains = [_zero_i32()] * 2
    for w in range(8):
        x = _four(b, act["q32"], b.add(first, ir.Constant(I64, 4 * w)))
        chains[w % 2] = signed_byte_quad_sums(b, isa, chains[w % 2], blk.bytes(2 + 4 * w, 32), x)
    acc = b.add(*chains)
    return (acc, b.fmul(blk.halves(0), splat(b, _scalar(b, act["d32"], i, F32), GROUP), flags=FAST)), None


def _q4_k(b, isa, blk, i, act):
    """d, dmin, 12 bytes packing eight 6-bit scales and mins, qs: 32 bytes hold 64 weights, low
    nibbles first. Scale u < 4 is byte u & 63, min u < 4 byte u + 4 & 63; for u >= 4 the low four
    bits come from byte u + 4 (scale: low nibble, min: high) and the top two from bits 6-7 of byte
    u - 4 (scale) or u (min)."""
    p0, p4, p8 = (blk.bytes(4 + plane, 32) for plane in (0, 4, 8))  # planes 0-3, 4-7, 8-11
    scales_low, mins_low = _and(b, p0, 63), _and(b, p4, 63)
    scales_high = b.or_(_and(b, p8, 15), _and(b, _shr(b, p0, 2), 0x30))
    mins_high = b.or_(_shr(b, p8, 4), _and(b, _shr(b, p4, 2), 0x30))
    first = b.mul(i, ir.Constant(I64, 256))
    chains = [_zero_i32()] * 16  # two per unit (see CHAINS)
    for word in range(32):  # word w of chunk c: weights 64c + 4w ... (low nibbles), 64c + 32 + 4w ... (high)
        chunk, w = divmod(word, 8)
        q = blk.bytes(16 + 4 * word, 32)
        for unit, values in ((2 * chunk, _and(b, q, 15)), (2 * chunk + 1, _shr(b, q, 4))):
            x = _four(b, act["q256"], b.add(first, ir.Constant(I64, 32 * unit + 4 * w)))
            chains[2 * unit + w % 2] = byte_quad_sums(b, isa, chains[2 * unit + w % 2], values, x)
    units = [b.add(chains[2 * u], chains[2 * u + 1]) for u in range(8)]
    scales = [_i32s(b, _plane(b, scales_low if u < 4 else scales_high, u % 4)) for u in range(8)]
    total = _sum(b, [b.mul(units[u], scales[u]) for u in range(8)])
    # the mins times the activations' sums over each unit's 32 weights
    sums16 = load_vector(b, act["sum16"], b.mul(i, ir.Constant(I64, 16)), I16, 16)
    pairs = [b.sext(b.shuffle_vector(sums16, sums16, const_vector(I32, range(k, 16, 2))), vector(I32, 8))
             for k in (0, 1)]
    sums32 = b.add(*pairs)
    mins = [_i32s(b, _plane(b, mins_low if u < 4 else mins_high, u % 4)) for u in range(8)]
    min_total = _sum(b, [b.mul(mins[u], b.shuffle_vector(sums32, sums32, const_vector(I32, [u] * GROUP)))
                         for u in range(8)])
    dx = splat(b, _scalar(b, act["d256"], i, F32), GROUP)
    return (total, b.fmul(blk.halves(0), dx, flags=FAST)), (min_total, b.fmul(blk.halves(2), dx, flags=FAST))


def _q6_k(b, isa, blk, i, act):
    """ql, qh, 16 signed 8-bit scales, d; 6-bit values offset by 32. Per 128-weight half h, ql
    byte l < 32 holds weights l (low nibble) and l + 64, byte l + 32 weights l + 32 and l + 96, and
    qh byte l their top two bits (bits 0-1, 2-3, 4-5, 6-7 for l, l + 32, l + 64, l + 96)."""
    first = b.mul(i, ir.Constant(I64, 256))
    groups = [_zero_i32()] * 16
    for h in range(2):
        for w in range(8):
            a, c, high = (blk.bytes(at, 32) for at in (64 * h + 4 * w, 64 * h + 32 + 4 * w, 128 + 32 * h + 4 * w))
            for quarter, low in enumerate((_and(b, a, 15), _and(b, c, 15), _shr(b, a, 4), _shr(b, c, 4))):
                values = b.or_(low, _shl(b, _and(b, _shr(b, high, 2 * quarter), 3), 4))
                at = 128 * h + 32 * quarter + 4 * w
                x = _four(b, act["q256"], b.add(first, ir.Constant(I64, at)))
                groups[at // 16] = byte_quad_sums(b, isa, groups[at // 16], values, x)
    sums16 = load_vector(b, act["sum16"], b.mul(i, ir.Constant(I64, 16)), I16, 16)
    offsets = b.mul(b.sext(sums16, vector(I32, 16)), const_vector(I32, [32] * 16))  # the offset times the sums
    scale_planes = blk.bytes(192, GROUP * 16)
    total = _sum(b, [b.mul(b.sub(groups[g], b.shuffle_vector(offsets, offsets, const_vector(I32, [g] * GROUP))),
                           _i32s(b, _plane(b, scale_planes, g), signed=True)) for g in range(16)])
    return (total, b.fmul(blk.halves(208), splat(b, _scalar(b, act["d256"], i, F32), GROUP), flags=FAST)), None


EMITTERS = {T.Q4_0: _q4_0, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k}


def _emit_group(b, isa, qtype, group_ptr, n_blocks, act):
    """<8 x float>: rows 0-7 of a group dotted with one token's activations."""
    block_bytes = GROUP * GGML_QUANT_SIZES[qtype][1]
    zero = ir.Constant(vector(F32, GROUP), [0.0] * GROUP)
    acc, min_acc = cgutils.alloca_once_value(b, zero), cgutils.alloca_once_value(b, zero)
    with cgutils.for_range(b, n_blocks) as loop:
        blk = _Block(b, qtype, offset(b, group_ptr, b.mul(loop.index, ir.Constant(I64, block_bytes))))
        for part, target in zip(EMITTERS[qtype](b, isa, blk, loop.index, act), (acc, min_acc)):
            if part is not None:
                ints, scale = part
                b.store(mul_add(b, b.sitofp(ints, vector(F32, GROUP)), scale, b.load(target)), target)
    return b.fsub(b.load(acc), b.load(min_acc), flags=FAST)


ACTIVATIONS = ("q32", "d32", "sum32", "ssum32", "q256", "d256", "sum16")


@intrinsic
def groups_dot_int8(typingctx, kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col):
    """out[t, col + r - first] = row r dotted with x[t], for rows first <= r < last (multiples of
    GROUP) and every token t < len(out), of a matrix of qtype in interleaved groups (w: (rows /
    GROUP, bytes)), x in the 8-bit format the type pairs with (activations.py). Callers guarantee
    last <= GROUP * len(w), x as long as a row for every token, col + last - first <=
    out.shape[1], and a qtype of LAYOUTS of those the array kinds' dtype names (type_sets)."""
    isa = int8_isa()
    qtypes = [t for t in tagged_types(kinds) if t in LAYOUTS]

    def codegen(context, b, signature, args):
        _, qtype_v, wv, first_v, last_v, *act_values, outv, colv = args
        w_type, out_type = signature.args[2], signature.args[12]
        n_tokens = array_shape(context, b, out_type, outv)[0]
        group_rows = ir.Constant(I64, GROUP)
        first_group = b.udiv(first_v, group_rows)

        def emit(qt):
            n_blocks = b.udiv(array_shape(context, b, w_type, wv)[1], ir.Constant(I64, GROUP * GGML_QUANT_SIZES[qt][1]))
            with cgutils.for_range(b, b.sub(b.udiv(last_v, group_rows), first_group)) as groups:
                group_ptr = array_row(context, b, w_type, wv, b.add(first_group, groups.index))
                with cgutils.for_range(b, n_tokens) as tokens:
                    t = tokens.index
                    act = {name: array_row(context, b, ty, v, t)
                           for name, ty, v in zip(ACTIVATIONS, signature.args[5:12], act_values)}
                    out_row = b.bitcast(array_row(context, b, out_type, outv, t), F32.as_pointer())
                    at = b.gep(out_row, [b.add(colv, b.mul(groups.index, group_rows))])
                    b.store(_emit_group(b, isa, qt, group_ptr, n_blocks, act),
                            b.bitcast(at, vector(F32, GROUP).as_pointer()), align=4)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col), codegen

