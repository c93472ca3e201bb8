"""Eight rows of a matrix interleaved so that one vector holds the same weights of all of them:
the 8-bit products then keep one row per vector lane, as llama.cpp's repacked types do
(ggml_gemv_q4_K_8x8_q8_K and its kin, b11434). Every quantized type has its layout.

A one-row product spends most of its instructions applying each unit's scale: a 32-weight unit's
products land in 16 lanes that all need that one scale (a Q4_K super-block takes ~78 vector
instructions), and every row ends in a horizontal sum.
With eight rows side by side, a 32-bit lane holds four weights of one row, vpdpbusd multiplies
them by the same four activations (one broadcast load) in every lane, and a group's scales are
one vector of the eight rows' scales: one multiply for all of them.

A group of GROUP rows keeps each block's bytes, rearranged: the block is cut into pieces (a scale,
four bytes of quants, ...; LAYOUTS), and each piece becomes that piece of the eight rows' blocks
side by side. So an interleaved block takes what the eight rows' blocks take in the file, and the
bit operations that decode one row's bytes decode eight rows' in the same instructions. The
rows are rearranged once, when the model loads, into a copy that replaces the mapped file's rows
(as llama.cpp's repacking does): embeddings read rows back out of the groups (row_blocks). The
precise path (16-bit activations) keeps the file's rows.

groups_dot_int8 takes TOKENS_PER_PASS tokens per pass over a group, so that each unit's weights
are decoded once for all of them (a verified draft's few tokens, or prefill's many: a matrix
product of 8-bit integers, which outruns BLAS on dequantized float32 tiles), and the tokens left
over in passes of fewer (rowdot.for_token_passes; a single decode step's alone).
"""
import mmap

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .block_ir import FP4_OFFSET, e8m0_half, fp4_values, iq4_values
from .cpu_features import int8_isa, target_features
from .rowdot import for_token_passes, switch_on_type
from .threads import in_parallel
from .type_sets import tagged_types
from .ir import (F32, I8, I16, I32, I64, array_row, array_shape, byte_pair_sums, byte_quad_sums, const_vector,
                 fused_mul_add, load_bytes, offset, pair_products, pair_products_into, prefetch_weights,
                 signed_byte_quad_sums, splat, vector)

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
    T.Q4_1: [(0, 2), (2, 2)] + _words(4, 16, 4),                             # d, m, qs
    T.Q5_0: [(0, 2), (2, 4)] + _words(6, 16, 4),                             # d, qh, qs
    T.Q5_1: [(0, 2), (2, 2), (4, 4)] + _words(8, 16, 4),                     # d, m, qh, qs
    T.Q8_0: [(0, 2)] + _words(2, 32, 4),                                     # d, qs
    T.MXFP4: [(0, 1)] + _words(1, 16, 4),                                    # e, qs
    T.Q2_K: [(80, 2), (82, 2)] + _words(0, 16, 1) + _words(16, 64, 4),     # d, dmin, scales, qs
    T.Q3_K: [(108, 2)] + _words(96, 12, 1) + _words(0, 32, 4) + _words(32, 64, 4),  # d, scales, hmask, qs
    T.Q4_K: [(0, 2), (2, 2)] + _words(4, 12, 1) + _words(16, 128, 4),       # d, dmin, scales, qs
    T.Q5_K: [(0, 2), (2, 2)] + _words(4, 12, 1) + _words(16, 32, 4) + _words(48, 128, 4),  # ..., qh, qs
    T.IQ4_NL: [(0, 2)] + _words(2, 16, 4),                                   # d, qs
    T.IQ4_XS: [(0, 2)] + _words(2, 6, 1) + _words(8, 128, 4),              # d, scales_h, scales_l, qs
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


def _runs(qtype) -> list:
    """LAYOUTS[qtype] with consecutive pieces of one size that follow each other in the file's
    block merged: (first byte, size, piece size)."""
    runs = []
    for first, size in LAYOUTS[qtype]:
        if runs and runs[-1][2] == size and runs[-1][0] + runs[-1][1] == first:
            runs[-1][1] += size
        else:
            runs.append([first, size, size])
    return runs


def _interleave(qtype, raw, out):
    """raw's rows (whole groups) into out, as interleave describes: a strided copy per run of
    pieces, pieces as items (numpy's copy loops move 4-byte items as words; a compiled gather of
    single bytes ran at a third of the speed, and loading pays it on every byte of the model)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    groups = raw.shape[0] // GROUP
    blocks = raw.reshape(groups, GROUP, -1, block_bytes)  # (group, lane, block, byte)
    out_blocks = out.reshape(groups, blocks.shape[2], GROUP * block_bytes)  # (group, block, byte)
    at = 0
    for first, size, piece in _runs(qtype):
        pieces = blocks[:, :, :, first:first + size].view(f"V{piece}")  # (group, lane, block, piece)
        target = out_blocks[:, :, at:at + GROUP * size].view(f"V{piece}")
        target.reshape(groups, blocks.shape[2], size // piece, GROUP)[...] = pieces.transpose(0, 2, 3, 1)
        at += GROUP * size


@njit(cache=True, nogil=True)
def row_blocks(groups, places, row, out):
    """out = row `row` of a matrix in interleaved groups, as the file lays it out."""
    block_bytes = places.shape[1]
    g, lane = row // GROUP, row % GROUP
    for i in range(out.shape[0] // block_bytes):
        group_block = groups[g, i * GROUP * block_bytes:(i + 1) * GROUP * block_bytes]
        for c in range(block_bytes):
            out[i * block_bytes + c] = group_block[places[0, c] + lane * places[1, c]]


def _populated(shape: tuple) -> np.ndarray:
    """Fresh uint8 memory of this shape, its pages mapped in one call (MAP_POPULATE) where the
    system has it: a page fault per 4 KiB, as a virtual machine takes them, costs loading more
    than the copy into them."""
    size = int(np.prod(shape))
    if size < 1 << 20 or not hasattr(mmap, "MAP_POPULATE"):
        return np.empty(shape, dtype=np.uint8)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(pages, dtype=np.uint8).reshape(shape)


def interleave(qtype, raw: np.ndarray) -> np.ndarray:
    """The rows of raw (rows, bytes per row) in interleaved groups: (rows / GROUP, bytes per row *
    GROUP), on all threads (threads.py's: a kernel of Numba's parallel loops would add its compile
    to the first run's)."""
    out = _populated((raw.shape[0] // GROUP, raw.shape[1] * GROUP))
    raw = np.ascontiguousarray(raw)
    in_parallel(lambda first, last: _interleave(qtype, raw[GROUP * first:GROUP * last], out[first:last]),
                out.shape[0], max_tile=4096)
    return out


class Block:
    """One interleaved block at `ptr`: its pieces for all GROUP rows (layout: a type's LAYOUTS)."""

    def __init__(self, b, layout, ptr):
        self.b, self.ptr, self.starts = b, ptr, {}
        at = 0
        for first, size in layout:
            self.starts[first] = at
            at += GROUP * size

    def bytes(self, first, n, ahead=None):
        """n bytes of the interleaved block from the piece at byte `first` of a file block:
        <n x i8> (that piece of rows 0-7, and what follows); `ahead` (an i64 value) bytes
        further on where given."""
        ptr = self.ptr if ahead is None else offset(self.b, self.ptr, ahead)
        return load_bytes(self.b, ptr, self.starts[first], n)

    def halves(self, first):
        """A float16 of every row (the piece at byte `first`) as <8 x float>."""
        at = self.b.bitcast(offset(self.b, self.ptr, self.starts[first]), vector(ir.HalfType(), GROUP).as_pointer())
        return self.b.fpext(self.b.load(at, align=1), vector(F32, GROUP))

    def floats(self, first):
        """A float32 of every row (the piece at byte `first`) as <8 x float>."""
        at = self.b.bitcast(offset(self.b, self.ptr, self.starts[first]), vector(F32, GROUP).as_pointer())
        return self.b.load(at, align=4)


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


class _Unit:
    """Weights of a block that share an integer scale: `words`, (<32 x i8> values: four
    weights of each of the eight rows, position of their first weight in the block: an int or
    an i64 value), split over `chains` accumulators; `scale` (<8 x i32>, the rows' scales, or
    None for 1) multiplies their sum."""

    def __init__(self, words, chains, scale=None):
        self.words, self.chains, self.scale = words, chains, scale


def _sixteen_planes(b, blk, first):
    """The 16 one-byte pieces from byte `first` of a file block (a K-quant's 16 groups' scales),
    each as <8 x i8> of the eight rows."""
    planes = blk.bytes(first, GROUP * 16)
    return [_plane(b, planes, g) for g in range(16)]


def _group_sums(b, isa, factors, act, i):
    """<8 x i32>: the sum over the 16 groups g of 16 weights of K-quant super-block i of
    factors[g] (<8 x i16>, one per row) times the activations' sum over the group (sum16): two
    groups per vpmaddwd (vpdpwssd), with one broadcast load of their two sums."""
    chains = [_zero_i32()] * 2
    for p in range(8):
        pair = b.shuffle_vector(factors[2 * p], factors[2 * p + 1],
                                const_vector(I32, [j for r in range(GROUP) for j in (r, GROUP + r)]))
        sums = b.bitcast(_four(b, act["sum16"], b.add(b.mul(i, ir.Constant(I64, 32)), ir.Constant(I64, 4 * p))),
                         vector(I16, 2 * GROUP))
        chains[p % 2] = pair_products_into(b, isa, chains[p % 2], pair, sums)
    return b.add(*chains)


# Each type (a _Kind): units(b, blk, step, scale) yields the units of one of the block's `steps`
# (an i64 value: the steps are a loop, so that LLVM keeps each step's decoding to itself; a block
# unrolled whole had its decoding for all units hoisted to the top and spilled, ~300 stack
# accesses per Q4_K super-block and four tokens), decoded when the products reach them (tokens
# share them); scale(j) loads integer scale j of the block's scale_table(b, blk) (or None);
# scales(b, blk, i, act) gives the float scale of the block's integer total for a
# token, correction(b, isa, blk, i, act) the integers to subtract from that total first (for
# weights stored with an offset), and mins(b, isa, blk, i, act) what the blocks' mins add to the
# products (<8 x float>), or None. A unit's multiply-adds run in chains of at most four (each waits ~5
# cycles for the one before): longer chains keep the products from keeping up with memory.

def _scale_times_dx(name, dx):
    def scales(b, blk, i, act):
        return b.fmul(blk.halves(name), splat(b, _scalar(b, act[dx], i, F32), GROUP))
    return scales


class _Kind:
    activations = "q256"  # the activations' format: "q32" (Q8_0) or "q256" (Q8_K)
    signed = False  # whether the weights' integers are signed bytes
    top = 15  # the largest of the weights' (unsigned) integers
    steps = 1

    @staticmethod
    def scale_table(b, blk):
        return None

    @staticmethod
    def correction(b, isa, blk, i, act):
        return None

    @staticmethod
    def mins(b, isa, blk, i, act):
        return None


def _nibbles(b, blk, at, fifth_bits=None):
    """A 32-weight block's values as two-word units' words: qs at `at` (byte j: weight j in the
    low nibble, j + 16 in the high one), with fifth bits from the qh piece at fifth_bits (bit j:
    weight j's) for Q5_0/Q5_1."""
    q = [blk.bytes(at + 4 * w, 32) for w in range(4)]
    words = [(_and(b, q[w], 15), 4 * w) for w in range(4)] + [(_shr(b, q[w], 4), 16 + 4 * w) for w in range(4)]
    if fifth_bits is None:
        return words
    qh = blk.bytes(fifth_bits, 32)
    return [(_with_fifth_bits(b, values, qh, first), first) for values, first in words]


def _with_fifth_bits(b, values, qh, first):
    """values (four weights first.. of each row) plus 16 where the row's qh has their bit: the
    byte of qh that holds the four bits spread over the row's four bytes, tested bit by bit (one
    vptestmb and a masked or with AVX-512)."""
    spread = b.shuffle_vector(qh, qh, const_vector(I32, [4 * (j // 4) + first // 8 for j in range(32)]))
    bits = b.and_(spread, const_vector(I8, [1 << (first % 8 + j % 4) for j in range(32)]))
    mask = b.icmp_unsigned("!=", bits, ir.Constant(vector(I8, 32), [0] * 32))
    return b.select(mask, b.or_(values, const_vector(I8, [16] * 32)), values)


def _offset_times_sums(offset):
    """correction for 32-weight blocks stored with an offset: it times the activations' sum."""
    def correction(b, isa, blk, i, act):
        return splat(b, b.mul(_scalar(b, act["sum32"], i, I32), ir.Constant(I32, offset)), GROUP)
    return staticmethod(correction)


def _min_times_sums(b, isa, blk, i, act):
    """mins for 32-weight blocks with a float16 min m at byte 2: m times the activations' sum."""
    return b.fmul(blk.halves(2), splat(b, _scalar(b, act["ssum32"], i, F32), GROUP))


class _Q4_0(_Kind):  # d, qs; offset 8
    activations = "q32"
    scales = staticmethod(_scale_times_dx(0, "d32"))
    correction = _offset_times_sums(8)

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit(_nibbles(b, blk, 2), 2)


class _Q4_1(_Kind):  # d, m, qs
    activations = "q32"
    scales = staticmethod(_scale_times_dx(0, "d32"))
    mins = staticmethod(_min_times_sums)

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit(_nibbles(b, blk, 4), 2)


class _Q5_0(_Kind):  # d, qh, qs; offset 16
    activations = "q32"
    top = 31
    scales = staticmethod(_scale_times_dx(0, "d32"))
    correction = _offset_times_sums(16)

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit(_nibbles(b, blk, 6, fifth_bits=2), 2)


class _Q5_1(_Kind):  # d, m, qh, qs
    activations = "q32"
    top = 31
    scales = staticmethod(_scale_times_dx(0, "d32"))
    mins = staticmethod(_min_times_sums)

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit(_nibbles(b, blk, 8, fifth_bits=4), 2)


class _Q8_0(_Kind):  # d, qs: signed
    activations = "q32"
    signed = True
    scales = staticmethod(_scale_times_dx(0, "d32"))

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit([(blk.bytes(2 + 4 * w, 32), 4 * w) for w in range(8)], 2)


class _MXFP4(_Kind):  # e, qs: 4-bit codes of signed values, offset to unsigned bytes
    activations = "q32"
    top = 2 * FP4_OFFSET
    correction = _offset_times_sums(FP4_OFFSET)

    @staticmethod
    def scales(b, blk, i, act):
        e = blk.bytes(0, GROUP)
        return b.fmul(e8m0_half(b, e), splat(b, _scalar(b, act["d32"], i, F32), GROUP))

    @staticmethod
    def units(b, blk, step, scale):
        yield _Unit([(fp4_values(b, codes), first) for codes, first in _nibbles(b, blk, 1)], 2)


class _IQ4_NL(_Kind):  # d, qs: Q4_0's nibbles, codes of signed values
    activations = "q32"
    signed = True
    plus = 0  # added to the values (IQ4_OFFSET: the unsigned kinds)
    scales = staticmethod(_scale_times_dx(0, "d32"))

    @classmethod
    def units(cls, b, blk, step, scale):
        yield _Unit([(iq4_values(b, codes, cls.plus), first) for codes, first in _nibbles(b, blk, 2)], 2)


class _IQ4_XS(_Kind):
    """d, scales_h, scales_l, qs: eight IQ4_NL blocks' codes (group g: 16 bytes from 16g) under
    6-bit scales minus 32, the low four bits of group g's in nibble g % 2 of scales_l byte g // 2,
    the top two in bits 2g % 8 of scales_h byte g // 4."""
    signed = True
    plus = 0
    scales = staticmethod(_scale_times_dx(0, "d256"))

    steps = 4  # two groups a step

    @staticmethod
    def scale_table(b, blk):
        planes = blk.bytes(2, GROUP * 6)  # scales_h's two bytes, then scales_l's four
        table = []
        for g in range(8):
            low = _and(b, _shr(b, _plane(b, planes, 2 + g // 2), 4 * (g % 2)), 15)
            high = _and(b, _shr(b, _plane(b, planes, g // 4), 2 * (g % 4)), 3)
            table.append(b.sub(_i32s(b, b.or_(low, _shl(b, high, 4))), const_vector(I32, [32] * GROUP)))
        return table

    @classmethod
    def units(cls, b, blk, step, scale):
        """Step s: groups 2s and 2s + 1, four words each, whose low nibbles hold weights 32g + 4w
        ... and high ones 32g + 16 + 4w ... of each row."""
        qs = [blk.bytes(8 + 4 * w, 32, ahead=b.mul(step, ir.Constant(I64, GROUP * 32))) for w in range(8)]
        for half in (0, 1):
            first = b.add(b.mul(step, ir.Constant(I64, 64)), ir.Constant(I64, 32 * half))
            words = [(iq4_values(b, nibble, cls.plus), b.add(first, ir.Constant(I64, 16 * high + 4 * w)))
                     for high, nibble_of in ((0, lambda q: _and(b, q, 15)), (1, lambda q: _shr(b, q, 4)))
                     for w, nibble in enumerate(nibble_of(q) for q in qs[4 * half:4 * half + 4])]
            yield _Unit(words, 2, scale=scale(b.add(b.mul(step, ir.Constant(I64, 2)), ir.Constant(I64, half))))


class _Q2_K(_Kind):
    """scales (byte g: group g's scale in the low nibble, its min in the high one), qs, d, dmin.
    Byte l of chunk c's 32 holds weights 128c + 32j + l in bits 2j, 2j + 1; group g is weights
    16g ... 16g + 15."""
    steps = 2  # chunks
    top = 3
    scales = staticmethod(_scale_times_dx(80, "d256"))
    qs = 16  # where the 2-bit quants start

    @classmethod
    def scale_table(cls, b, blk):
        return [_i32s(b, _and(b, plane, 15)) for plane in _sixteen_planes(b, blk, 0)]

    @classmethod
    def units(cls, b, blk, step, scale):
        """Step c: eight words of its 32 bytes, each four units' (one per bit pair j)."""
        qs = [blk.bytes(cls.qs + 4 * w, 32, ahead=b.mul(step, ir.Constant(I64, GROUP * 32))) for w in range(8)]
        first = b.mul(step, ir.Constant(I64, 128))
        for j in range(4):
            for half in range(2):
                words = [(cls._high_bits(b, blk, step, j, w, _and(b, _shr(b, qs[w], 2 * j), 3)),
                          b.add(first, ir.Constant(I64, 32 * j + 4 * w))) for w in range(4 * half, 4 * half + 4)]
                yield _Unit(words, 1, scale=scale(b.add(b.mul(step, ir.Constant(I64, 8)), ir.Constant(I64, 2 * j + half))))

    @staticmethod
    def _high_bits(b, blk, chunk, j, w, values):
        return values

    @classmethod
    def mins(cls, b, isa, blk, i, act):
        """The groups' mins times the activations' sums over them."""
        mins = [b.zext(_shr(b, plane, 4), vector(I16, GROUP)) for plane in _sixteen_planes(b, blk, 0)]
        sums = b.sitofp(_group_sums(b, isa, mins, act, i), vector(F32, GROUP))
        dx = splat(b, _scalar(b, act["d256"], i, F32), GROUP)
        return b.fmul(sums, b.fneg(b.fmul(blk.halves(82), dx)))


class _Q3_K(_Q2_K):
    """hmask, qs (as Q2_K's: the low two bits), 12 bytes packing sixteen 6-bit scales offset by
    32, d. Bit 4c + j of hmask byte l is the third bit of weight 128c + 32j + l; the values are
    offset by 4. Scale j = 4k + m: the low four bits are nibble k // 2 of byte 4 (k % 2) + m, the
    top two bits 2k, 2k + 1 of byte 8 + m."""
    top = 7
    scales = staticmethod(_scale_times_dx(108, "d256"))
    qs = 32

    @staticmethod
    def _scales(b, blk):
        """The sixteen groups' scales as <8 x i8> (of the eight rows), offset removed."""
        planes = blk.bytes(96, GROUP * 12)
        scales = []
        for j in range(16):
            k, m = divmod(j, 4)
            low = _and(b, _shr(b, _plane(b, planes, 4 * (k % 2) + m), 4 * (k // 2)), 15)
            top = _shl(b, _and(b, _shr(b, _plane(b, planes, 8 + m), 2 * k), 3), 4)
            scales.append(b.sub(b.or_(low, top), const_vector(I8, [32] * GROUP)))
        return scales

    @classmethod
    def scale_table(cls, b, blk):
        return [_i32s(b, scale, signed=True) for scale in cls._scales(b, blk)]

    @staticmethod
    def _high_bits(b, blk, chunk, j, w, values):
        bit = b.trunc(b.shl(ir.Constant(I64, 1), b.add(b.mul(chunk, ir.Constant(I64, 4)), ir.Constant(I64, j))), I8)
        is_set = b.icmp_unsigned("!=", b.and_(blk.bytes(4 * w, 32), splat(b, bit, 32)),
                                 ir.Constant(vector(I8, 32), [0] * 32))
        return b.select(is_set, b.or_(values, const_vector(I8, [4] * 32)), values)

    @staticmethod
    def mins(b, isa, blk, i, act):
        return None

    @classmethod
    def correction(cls, b, isa, blk, i, act):
        """The offset, 4, times each group's scale and activations' sum."""
        sums = _group_sums(b, isa, [b.sext(s, vector(I16, GROUP)) for s in cls._scales(b, blk)], act, i)
        return b.shl(sums, const_vector(I32, [2] * GROUP))


class _Q4_K(_Kind):
    """d, dmin, 12 bytes packing eight 6-bit scales and mins, qs: 32 bytes hold 64 weights, low
    nibbles first. Scale u < 4 is byte u & 63, min u < 4 byte u + 4 & 63; for u >= 4 the low four
    bits come from byte u + 4 (scale: low nibble, min: high) and the top two from bits 6-7 of byte
    u - 4 (scale) or u (min)."""
    scales = staticmethod(_scale_times_dx(0, "d256"))

    steps = 4  # the 32 bytes of each word hold two units: low nibbles, high ones

    @staticmethod
    def _planes(b, blk, which):
        """The eight units' scales (which = 0) or mins (1), as <8 x i8> of the eight rows."""
        p0, p4, p8 = (blk.bytes(4 + plane, 32) for plane in (0, 4, 8))  # planes 0-3, 4-7, 8-11
        if which == 0:
            planes = (_and(b, p0, 63), b.or_(_and(b, p8, 15), _and(b, _shr(b, p0, 2), 0x30)))
        else:
            planes = (_and(b, p4, 63), b.or_(_shr(b, p8, 4), _and(b, _shr(b, p4, 2), 0x30)))
        return [_plane(b, planes[u // 4], u % 4) for u in range(8)]

    @classmethod
    def scale_table(cls, b, blk):
        return [_i32s(b, scale) for scale in cls._planes(b, blk, 0)]

    qs = 16  # where the quants start

    @classmethod
    def units(cls, b, blk, step, scale):
        """Word w of chunk c (the step) holds weights 64c + 4w ... (low nibbles) and 64c + 32 +
        4w ... (high) of each row."""
        qs = [blk.bytes(cls.qs + 4 * w, 32, ahead=b.mul(step, ir.Constant(I64, GROUP * 32))) for w in range(8)]
        first = b.mul(step, ir.Constant(I64, 64))
        for high in (0, 1):
            values = [cls._fifth_bits(b, blk, step, high, w, _shr(b, q, 4) if high else _and(b, q, 15))
                      for w, q in enumerate(qs)]
            words = [(v, b.add(first, ir.Constant(I64, 32 * high + 4 * w))) for w, v in enumerate(values)]
            yield _Unit(words, 2, scale=scale(b.add(b.mul(step, ir.Constant(I64, 2)), ir.Constant(I64, high))))

    @staticmethod
    def _fifth_bits(b, blk, chunk, high, w, values):
        return values

    @classmethod
    def mins(cls, b, isa, blk, i, act):
        """The mins times the activations' sums over each unit's 32 weights (two groups of 16)."""
        mins = [b.zext(m, vector(I16, GROUP)) for m in cls._planes(b, blk, 1)]
        sums = b.sitofp(_group_sums(b, isa, [mins[g // 2] for g in range(16)], act, i), vector(F32, GROUP))
        dx = splat(b, _scalar(b, act["d256"], i, F32), GROUP)
        return b.fmul(sums, b.fneg(b.fmul(blk.halves(2), dx)))


class _Q5_K(_Q4_K):
    """Q4_K's layout with qh (32 bytes) before qs: bit 2c of qh byte l is the fifth bit of
    weight 64c + l, bit 2c + 1 that of weight 64c + 32 + l."""
    top = 31
    qs = 48

    @staticmethod
    def _fifth_bits(b, blk, chunk, high, w, values):
        bit = b.trunc(b.shl(ir.Constant(I64, 1), b.add(b.mul(chunk, ir.Constant(I64, 2)), ir.Constant(I64, high))), I8)
        is_set = b.icmp_unsigned("!=", b.and_(blk.bytes(16 + 4 * w, 32), splat(b, bit, 32)),
                                 ir.Constant(vector(I8, 32), [0] * 32))
        return b.select(is_set, b.or_(values, const_vector(I8, [16] * 32)), values)


class _Q6_K(_Kind):
    """ql, qh, 16 signed 8-bit scales, d; 6-bit values offset by 32. Per 128-weight half h, ql
    byte l < 32 holds weights l (low nibble) and l + 64, byte l + 32 weights l + 32 and l + 96, and
    qh byte l their top two bits (bits 0-1, 2-3, 4-5, 6-7 for l, l + 32, l + 64, l + 96)."""
    top = 63
    scales = staticmethod(_scale_times_dx(208, "d256"))

    steps = 4  # (h, half): four words of each of ql's halves and qh, which hold four groups

    @classmethod
    def scale_table(cls, b, blk):
        return [_i32s(b, scale, signed=True) for scale in _sixteen_planes(b, blk, 192)]

    @staticmethod
    def units(b, blk, step, scale):
        """Step 2h + half: words w = 4 half ... 4 half + 3 of 128-weight half h, whose pieces of
        ql and qh follow those of step 0 by 4 * 3 pieces a step; group g = 8h + 2 quarter + half
        holds weights 128h + 32 quarter + 4w."""
        h, half = b.lshr(step, ir.Constant(I64, 1)), b.and_(step, ir.Constant(I64, 1))
        ahead = b.mul(step, ir.Constant(I64, 4 * 3 * GROUP * 4))
        pieces = [[blk.bytes(at, 32, ahead) for at in (4 * w, 32 + 4 * w, 128 + 4 * w)] for w in range(4)]
        first = b.add(b.mul(h, ir.Constant(I64, 128)), b.mul(half, ir.Constant(I64, 16)))
        group = b.add(b.mul(h, ir.Constant(I64, 8)), half)
        for quarter in range(4):
            words = []
            for w, (a, c, high) in enumerate(pieces):
                low = _and(b, (a, c)[quarter % 2], 15) if quarter < 2 else _shr(b, (a, c)[quarter % 2], 4)
                words.append((b.or_(low, _shl(b, _and(b, _shr(b, high, 2 * quarter), 3), 4)),
                              b.add(first, ir.Constant(I64, 32 * quarter + 4 * w))))
            yield _Unit(words, 1, scale=scale(b.add(group, ir.Constant(I64, 2 * quarter))))

    @classmethod
    def correction(cls, b, isa, blk, i, act):
        """The offset, 32, times each group's scale and activations' sum."""
        sums = _group_sums(b, isa, [b.sext(s, vector(I16, GROUP)) for s in _sixteen_planes(b, blk, 192)], act, i)
        return b.shl(sums, const_vector(I32, [5] * GROUP))


# The IQ4 values plus 128 are unsigned bytes: on VNNI, vpdpbusd then takes them as they are (the
# offset times the activations' sums taken off once a block), where signed ones take a sign flip
# per token and word. AVX2's pair sums would saturate on them, and AMX's tiles take signed bytes:
# those keep the signed kinds (the integer totals, and so the products, are the same bits).
IQ4_OFFSET = 128


class _IQ4_NL_Unsigned(_IQ4_NL):
    signed, plus, top = False, IQ4_OFFSET, 255
    correction = _offset_times_sums(IQ4_OFFSET)


class _IQ4_XS_Unsigned(_IQ4_XS):
    signed, plus, top = False, IQ4_OFFSET, 255

    @classmethod
    def correction(cls, b, isa, blk, i, act):
        """The offset times each group's scale (one per 32 weights) and activations' sums."""
        table = cls.scale_table(b, blk)
        factors = [b.trunc(table[g // 2], vector(I16, GROUP)) for g in range(16)]
        return b.shl(_group_sums(b, isa, factors, act, i), const_vector(I32, [7] * GROUP))


VNNI_KINDS = {T.IQ4_NL: _IQ4_NL_Unsigned, T.IQ4_XS: _IQ4_XS_Unsigned}


KINDS = {T.Q4_0: _Q4_0, T.Q4_1: _Q4_1, T.Q5_0: _Q5_0, T.Q5_1: _Q5_1, T.Q8_0: _Q8_0, T.MXFP4: _MXFP4, T.Q2_K: _Q2_K,
         T.Q3_K: _Q3_K, T.Q4_K: _Q4_K, T.Q5_K: _Q5_K, T.Q6_K: _Q6_K, T.IQ4_NL: _IQ4_NL, T.IQ4_XS: _IQ4_XS}


def _unit_sums(b, isa, kind, unit, xs):
    """<8 x i32>: the unit's words times their activations xs, summed per row and scaled: one
    vpdpbusd a word (VNNI; on AVX2 only for the signed weights of Q8_0 and the IQ4 types)."""
    dot = signed_byte_quad_sums if kind.signed else byte_quad_sums
    chains = [_zero_i32()] * unit.chains
    for j, ((values, _), x) in enumerate(zip(unit.words, xs)):
        chains[j % unit.chains] = dot(b, isa, chains[j % unit.chains], values, x)
    ints = _sum(b, chains)
    return ints if unit.scale is None else b.mul(ints, unit.scale)


def _unit_sums_int16(b, isa, kind, unit, xs):
    """_unit_sums on AVX2: vpmaddubsw's pair sums (at most 2 * top * 128 each) added as int16 in
    runs that cannot overflow, then one vpmaddwd a run against the unit's scale (scale_table in
    _as_word_pairs form) or ones: fewer instructions than widening each word with a vpmaddwd and
    an add and applying the scale with a vpmulld (17 against 26 for a Q4_K unit; llama.cpp's AVX2
    kernels multiply by the scales in vpmaddwd too)."""
    run = 32767 // (2 * kind.top * 128)
    factors = const_vector(I16, [1] * 16) if unit.scale is None else b.bitcast(unit.scale, vector(I16, 16))
    total = None
    for start in range(0, len(xs), run):
        words = [byte_pair_sums(b, isa, values, x) for (values, _), x in
                 zip(unit.words[start:start + run], xs[start:start + run])]
        ints = pair_products(b, _sum(b, words), factors)
        total = ints if total is None else b.add(total, ints)
    return total


def _as_word_pairs(b, scale):
    """<8 x i32> of int16-sized scales -> each scale in both 16-bit halves of its lane: a
    vpmaddwd factor that multiplies both pair sums of the lane by it."""
    low = b.and_(scale, const_vector(I32, [0xFFFF] * GROUP))
    return b.or_(low, b.shl(scale, const_vector(I32, [16] * GROUP)))


def kind_for(qtype, isa):
    """The _Kind that multiplies qtype's groups on this instruction set."""
    return VNNI_KINDS.get(qtype, KINDS[qtype]) if isa == "vnni" else KINDS[qtype]


def _emit_groups(b, isa, qtype, group_ptr, n_blocks, acts, from_memory):
    """[<8 x float>]: rows 0-7 of a group of qtype dotted with each token's activations (acts: one
    dict per token). Each unit's weights are decoded once for all the tokens. from_memory (an i1
    value): whether this pass is the first over the group, which reads it from memory."""
    kind, layout = kind_for(qtype, isa), LAYOUTS[qtype]
    block, block_bytes = GGML_QUANT_SIZES[qtype][0], GROUP * GGML_QUANT_SIZES[qtype][1]
    lines_per_step = -(-block_bytes // (64 * kind.steps))  # (cache lines each step fetches ahead)
    zero = ir.Constant(vector(F32, GROUP), [0.0] * GROUP)
    accs = [cgutils.alloca_once_value(b, zero) for _ in acts]
    totals = [cgutils.alloca_once(b, vector(I32, GROUP)) for _ in acts]  # a block's integer sums
    scales = cgutils.alloca_once(b, vector(I32, GROUP), size=16)  # its scale_table
    in_int16 = isa == "avx2" and not kind.signed
    with cgutils.for_range(b, n_blocks) as loop:
        i = loop.index
        blk = Block(b, layout, offset(b, group_ptr, b.mul(i, ir.Constant(I64, block_bytes))))
        first = b.mul(i, ir.Constant(I64, block))
        table = kind.scale_table(b, blk)
        if table is not None:
            for j, scale in enumerate(table):
                b.store(_as_word_pairs(b, scale) if in_int16 else scale, b.gep(scales, [ir.Constant(I64, j)]))
        for total in totals:
            b.store(_zero_i32(), total)
        with cgutils.for_range(b, ir.Constant(I64, kind.steps)) as step:
            # The first pass over a group reads it from memory, the passes after it from L1: the
            # first fetches the cache lines PREFETCH_BYTES ahead, a step's share of the block in
            # each step (a K-quant super-block's fetches issued all at once, before its steps,
            # leave its arithmetic waiting on them). A pass of several tokens fetches
            # PASS_PREFETCH_BYTES ahead into L2 instead (see ir.PASS_PREFETCH_BYTES).
            with b.if_then(from_memory):
                at = b.mul(step.index, ir.Constant(I64, 64 * lines_per_step))
                for line in range(lines_per_step):
                    prefetch_weights(b, offset(b, blk.ptr, b.add(at, ir.Constant(I64, 64 * line))), len(acts))
            for unit in kind.units(b, blk, step.index, lambda j: b.load(b.gep(scales, [j]))):
                for act, total in zip(acts, totals):
                    xs = [_four(b, act[kind.activations], b.add(first, ir.Constant(I64, at) if isinstance(at, int) else at))
                          for _, at in unit.words]
                    ints = (_unit_sums_int16 if in_int16 else _unit_sums)(b, isa, kind, unit, xs)
                    b.store(b.add(b.load(total), ints), total)
        for act, acc, total in zip(acts, accs, totals):
            b.store(b.fadd(b.load(acc), block_value(b, isa, kind, blk, i, act, b.load(total))), acc)
    return [b.load(acc) for acc in accs]


def block_value(b, isa, kind, blk, i, act, ints):
    """<8 x float>: what block i adds to a token's products with the group's rows, from the
    integer sums of its units (ints, <8 x i32>, each unit's times its scale) and the token's
    activations act."""
    correction = kind.correction(b, isa, blk, i, act)
    ints = ints if correction is None else b.sub(ints, correction)
    # (float operations in a fixed order, no fast-math regrouping: a token's sums round alike in
    # a pass of one token and of several, see groups_dot_int8, and on AMX's tiles, amx_int8.py)
    values, scales = b.sitofp(ints, vector(F32, GROUP)), kind.scales(b, blk, i, act)
    mins = kind.mins(b, isa, blk, i, act)
    return b.fmul(values, scales) if mins is None else fused_mul_add(b, values, scales, mins)


ACTIVATIONS = ("q32", "d32", "sum32", "ssum32", "q256", "d256", "sum16")


# Tokens per pass over a group: their accumulators fit AVX-512's 32 registers (AVX2 has 16).
TOKENS_PER_PASS = 4 if "avx512vl" in target_features() else 2


@intrinsic
def groups_dot_int8(typingctx, kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col):
    """out[t, col + r - first] = row r dotted with x[t], for rows first <= r < last (multiples of
    GROUP) and every token t < len(out), of a matrix of qtype in interleaved groups (w: (rows /
    GROUP, bytes)), x in the 8-bit format the type pairs with (activations.py). Callers guarantee
    last <= GROUP * len(w), x as long as a row for every token, col + last - first <=
    out.shape[1], and a qtype of LAYOUTS of those the array kinds' dtype names (type_sets).

    The tokens go TOKENS_PER_PASS at a time over each group, each unit's weights decoded once for
    all of them, then what is left in passes of fewer (rowdot.for_token_passes): a token's sums
    are the same instructions in a pass of any size, so a token's products are bit for bit the
    same whatever tokens it comes with (speculative decoding relies on it: a verified draft's
    logits are a plain step's)."""
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

                def store(tokens):
                    acts = [{name: array_row(context, b, ty, v, t)
                             for name, ty, v in zip(ACTIVATIONS, signature.args[5:12], act_values)} for t in tokens]
                    first_pass = b.icmp_unsigned("==", tokens[0], ir.Constant(I64, 0))
                    for t, value in zip(tokens, _emit_groups(b, isa, qt, group_ptr, n_blocks, acts, first_pass)):
                        out_row = b.bitcast(array_row(context, b, out_type, outv, t), F32.as_pointer())
                        at = b.gep(out_row, [b.add(colv, b.mul(groups.index, group_rows))])
                        b.store(value, b.bitcast(at, vector(F32, GROUP).as_pointer()), align=4)
                for_token_passes(b, n_tokens, TOKENS_PER_PASS, store)
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return types.none(kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col), codegen
