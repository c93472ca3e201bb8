"""Each quantized type's block layout, decoded in LLVM IR to float vectors (byte layouts: ggml-common.h).

A decoder reads one block at pointer `p` and returns a Block: its scale groups in order, each as
Group(scale, bias, values, signed): weight = scale * value + bias, with `values` the group's 16
or 32 integer values as <16 x i8> vectors in position order (signed or unsigned bytes). `bias` is
None for symmetric types, whose integer offset (Q4_0's -8 ...) is subtracted in the bytes
instead. In K-quants, scale and bias are the groups' integer sub-scales and mins (i32), which the
block's float d and dmin turn into weight = d * scale * value - dmin * bias: products can then
stay integers over a whole super-block. rowdot.py multiplies the blocks with activations or
writes them out as floats; nothing here knows about rows or tokens.
"""
from dataclasses import dataclass

from llvmlite import ir
from gguf import GGMLQuantizationType as T

from .ir import F32, I8, I32, LANES, const_vector, load_byte, load_bytes, load_f16, load_u32


@dataclass
class Group:
    scale: ir.Value
    bias: ir.Value | None
    values: list
    signed: bool


@dataclass
class Block:
    groups: list
    d: ir.Value | None = None     # K-quants: float scale of the groups' integer scales ...
    dmin: ir.Value | None = None  # ... and of their integer mins

    def float_groups(self, b):
        """(scale, bias) of each group as float32 (bias None where there is none)."""
        if self.d is None:
            return [(g.scale, g.bias) for g in self.groups]
        return [(b.fmul(self.d, b.sitofp(g.scale, F32)),
                 None if g.bias is None else b.fneg(b.fmul(self.dmin, b.sitofp(g.bias, F32)))) for g in self.groups]


def _bytes_op(op):
    def apply(b, v, k):
        return op(b, v, const_vector(I8, [k] * v.type.count))
    return apply


_and = _bytes_op(lambda b, v, c: b.and_(v, c))
_shr = _bytes_op(lambda b, v, c: b.lshr(v, c))
_shl = _bytes_op(lambda b, v, c: b.shl(v, c))
_sub = _bytes_op(lambda b, v, c: b.sub(v, c))


def _bits(b, v, shift, mask):
    return _and(b, _shr(b, v, shift), mask)


def _nibble_halves(b, p, at):
    """16 bytes at p + at holding values j (low nibble) and j + 16 (high nibble) of a 32-block."""
    qs = load_bytes(b, p, at)
    return _and(b, qs, 15), _shr(b, qs, 4)


def _with_fifth_bits(b, v, qh, first, offset):
    """v (<16 x i8> nibbles) with its fifth bits, minus `offset`: lane j gains 16 when bit
    (first + j) of the 32-bit qh is set. Those 16 bits serve as a lane mask as they stand (a mask
    register on AVX-512, loaded straight from the block): Q5_0 products went from 12.7 to 16
    GMAC/s over spreading each bit to its lane with vector shifts."""
    bits = b.trunc(b.lshr(qh, ir.Constant(I32, first)), ir.IntType(LANES))
    mask = b.bitcast(bits, ir.VectorType(ir.IntType(1), LANES))
    return b.select(mask, _sub(b, v, offset - 16), _sub(b, v, offset))


def _q4_0(b, p):  # d:f16 qs[16]
    lo, hi = _nibble_halves(b, p, 2)
    return Block([Group(load_f16(b, p, 0), None, [_sub(b, v, 8) for v in (lo, hi)], True)])


def _q4_1(b, p):  # d:f16 m:f16 qs[16]
    lo, hi = _nibble_halves(b, p, 4)
    return Block([Group(load_f16(b, p, 0), load_f16(b, p, 2), [lo, hi], False)])


def _q5(b, p, qh_at, qs_at, offset):
    lo, hi = _nibble_halves(b, p, qs_at)
    qh = load_u32(b, p, qh_at)
    return _with_fifth_bits(b, lo, qh, 0, offset), _with_fifth_bits(b, hi, qh, 16, offset)


def _q5_0(b, p):  # d:f16 qh[4] qs[16]
    return Block([Group(load_f16(b, p, 0), None, list(_q5(b, p, 2, 6, 16)), True)])


def _q5_1(b, p):  # d:f16 m:f16 qh[4] qs[16]
    return Block([Group(load_f16(b, p, 0), load_f16(b, p, 2), list(_q5(b, p, 4, 8, 0)), False)])


def _q8_0(b, p):  # d:f16 qs[32] int8
    return Block([Group(load_f16(b, p, 0), None, [load_bytes(b, p, 2 + 16 * h) for h in (0, 1)], True)])


def _k4_scale_min(b, p, j):
    """Q4_K/Q5_K: the j-th 6-bit (scale, min) of the 12 packed bytes at p, as i32."""
    byte = lambda i: load_byte(b, p, i)  # noqa: E731
    if j < 4:
        return b.and_(byte(j), ir.Constant(I32, 63)), b.and_(byte(j + 4), ir.Constant(I32, 63))
    top = lambda i: b.shl(b.lshr(byte(i), ir.Constant(I32, 6)), ir.Constant(I32, 4))  # noqa: E731
    sc = b.or_(b.and_(byte(j + 4), ir.Constant(I32, 15)), top(j - 4))
    mn = b.or_(b.lshr(byte(j + 4), ir.Constant(I32, 4)), top(j))
    return sc, mn


def _k4_groups(b, p, values):
    """Q4_K/Q5_K: eight 32-weight groups with their packed scales and mins under d, dmin."""
    scales_at = b.gep(p, [ir.Constant(I32, 4)])
    return Block([Group(*_k4_scale_min(b, scales_at, j), v, False) for j, v in enumerate(values)],
                 load_f16(b, p, 0), load_f16(b, p, 2))


def _q4_k(b, p):  # d, dmin, scales[12], qs[128]: 32 bytes hold 64 weights, low nibbles first
    values = []
    for chunk in range(4):
        halves = [load_bytes(b, p, 16 + 32 * chunk + 16 * h) for h in (0, 1)]
        values += [[_and(b, v, 15) for v in halves], [_shr(b, v, 4) for v in halves]]
    return _k4_groups(b, p, values)


def _q5_k(b, p):  # d, dmin, scales[12], qh[32], qs[128]: bit 2c / 2c+1 of qh[l] tops chunk c
    qh = [load_bytes(b, p, 16 + 16 * h) for h in (0, 1)]
    values = []
    for chunk in range(4):
        halves = [load_bytes(b, p, 48 + 32 * chunk + 16 * h) for h in (0, 1)]
        for nibble, bit in ((lambda v: _and(b, v, 15), 2 * chunk), (lambda v: _shr(b, v, 4), 2 * chunk + 1)):
            values.append([b.or_(nibble(v), _shl(b, _bits(b, h, bit, 1), 4)) for v, h in zip(halves, qh)])
    return _k4_groups(b, p, values)


def _sixteens(groups_by_index):
    return [groups_by_index[g] for g in sorted(groups_by_index)]


def _q6_k(b, p):  # ql[128], qh[64], scales[16] int8, d: 6-bit values offset by 32
    d = load_f16(b, p, 208)
    groups = {}
    for half in range(2):
        for lane in (0, 1):  # weights l = 16 * lane ... 16 * lane + 15 of each 32-wide quarter
            a = load_bytes(b, p, 64 * half + 16 * lane)
            c = load_bytes(b, p, 64 * half + 32 + 16 * lane)
            h = load_bytes(b, p, 128 + 32 * half + 16 * lane)
            quarters = (_and(b, a, 15), _and(b, c, 15), _shr(b, a, 4), _shr(b, c, 4))
            for quarter, low in enumerate(quarters):
                g = 8 * half + 2 * quarter + lane
                value = _sub(b, b.or_(low, _shl(b, _bits(b, h, 2 * quarter, 3), 4)), 32)
                scale = b.sext(b.load(b.gep(p, [ir.Constant(I32, 192 + g)])), I32)
                groups[g] = Group(scale, None, [value], True)
    return Block(_sixteens(groups), d)


def _two_bit_planes(b, p, at, make_group):
    """Q2_K/Q3_K: 2-bit values in four planes of 32 bytes per 128-weight half; group g is 16 weights."""
    groups = {}
    for half in range(2):
        for lane in (0, 1):
            qs = load_bytes(b, p, at + 32 * half + 16 * lane)
            for plane in range(4):
                g = 8 * half + 2 * plane + lane
                groups[g] = make_group(g, half, plane, lane, _bits(b, qs, 2 * plane, 3))
    return _sixteens(groups)


def _q2_k(b, p):  # scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
    d, dmin = load_f16(b, p, 80), load_f16(b, p, 82)

    def group(g, half, plane, lane, v):
        sc = load_byte(b, p, g)
        return Group(b.and_(sc, ir.Constant(I32, 15)), b.lshr(sc, ir.Constant(I32, 4)), [v], False)
    return Block(_two_bit_planes(b, p, 16, group), d, dmin)


def _q3_k(b, p):  # hmask[32], qs[64], scales[12] (6-bit, packed, offset 32), d
    d = load_f16(b, p, 108)
    hmask = [load_bytes(b, p, 16 * lane) for lane in (0, 1)]

    def group(g, half, plane, lane, v):
        low = b.and_(b.lshr(load_byte(b, p, 96 + g % 8), ir.Constant(I32, 4 * (g // 8))), ir.Constant(I32, 15))
        high = b.and_(b.lshr(load_byte(b, p, 104 + g % 4), ir.Constant(I32, 2 * (g // 4))), ir.Constant(I32, 3))
        sc = b.sub(b.or_(low, b.shl(high, ir.Constant(I32, 4))), ir.Constant(I32, 32))
        # a clear high-mask bit means value - 4
        value = _sub(b, b.or_(v, _shl(b, _bits(b, hmask[lane], 4 * half + plane, 1), 2)), 4)
        return Group(sc, None, [value], True)
    return Block(_two_bit_planes(b, p, 32, group), d)


DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
            T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
