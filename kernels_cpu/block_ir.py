"""Each quantized type's block layout, decoded in LLVM IR to integer vectors (byte layouts: ggml-common.h).

A decoder reads one block at pointer `p` and returns a Block: its scale groups in order, each as
Group(scale, bias, values, signed, offset): weight = scale * (value - offset) + bias, with
`values` the group's 16 or 32 integer values as <16 x i8> or <32 x i8> vectors in position order
(signed or unsigned bytes). `bias` is None for symmetric types, whose integer offset (Q4_0's 8 ...)
is left apart: the 8-bit dot products multiply the unsigned values and subtract the offset times
the activations' sum, and `integers` subtracts it in the bytes for the other users. K-quant
groups leave scale and bias to their Block: integer sub-scales and mins, one i16 lane per group,
which the block's float d and dmin turn into weight = d * scale * (value - offset) - dmin * min;
products can then stay integers over a whole super-block. rowdot.py and rowdot_int8.py multiply
the blocks with activations, or rowdot.py writes them out as floats; nothing here knows about
rows or tokens.
"""
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from gguf import GGMLQuantizationType as T

from gguf_io.quant_types import IQ4_VALUES, MXFP4_VALUES, grid

from .cpu_features import target_features
from .ir import F32, I8, I16, I32, I64, concat, const_vector, load_bytes, load_f16, load_u32, offset, vector, x86_call


@dataclass
class Group:
    scale: ir.Value
    bias: ir.Value | None
    values: list
    signed: bool
    offset: int = 0
    # the i-quants' signs: an integer with a bit per value (in order) that negates it, the values
    # being magnitudes; an 8-bit product flips the activations' signs instead (one masked
    # subtraction, where signed weights take their magnitudes and signs apart again)
    negative: ir.Value | None = None

    def integers(self, b):
        """(values - offset, signed): the weights' integers as bytes."""
        if self.negative is not None:
            whole = self.values[0] if len(self.values) == 1 else concat(b, *self.values)
            return [negated_where(b, whole, self.negative)], True
        if not self.offset:
            return self.values, self.signed
        return [_sub(b, v, self.offset) for v in self.values], True


@dataclass
class Block:
    groups: list
    d: ir.Value | None = None       # K-quants: float scale of the integer sub-scales ...
    dmin: ir.Value | None = None    # ... and of the integer mins
    scales: ir.Value | None = None  # K-quants: <groups x i16>, each group's integer scale
    mins: ir.Value | None = None    # K-quants with mins: <groups x i16>, each group's integer min

    def float_groups(self, b):
        """(scale, bias) of each group as float32 (bias None where there is none)."""
        if self.d is None:
            return [(g.scale, g.bias) for g in self.groups]

        def lane(v, i):
            return b.sitofp(b.extract_element(v, ir.Constant(I32, i)), F32)
        return [(b.fmul(self.d, lane(self.scales, i)),
                 None if self.mins is None else b.fneg(b.fmul(self.dmin, lane(self.mins, i))))
                for i in range(len(self.groups))]


def _pick(b, v, lanes):
    """The bytes of v at `lanes`, as a vector of len(lanes)."""
    return b.shuffle_vector(v, v, const_vector(I32, lanes))


def _lanes_op(op):
    """op(b, v, c) against a constant vector c: one value per lane (a list) or the same value in
    every lane (an int)."""
    def apply(b, v, ks):
        return op(b, v, const_vector(v.type.element, [ks] * v.type.count if isinstance(ks, int) else ks))
    return apply


_and = _lanes_op(lambda b, v, c: b.and_(v, c))
_shr = _lanes_op(lambda b, v, c: b.lshr(v, c))
_shl = _lanes_op(lambda b, v, c: b.shl(v, c))
_sub = _lanes_op(lambda b, v, c: b.sub(v, c))


def _bits(b, v, shift, mask):
    return _and(b, _shr(b, v, shift), mask)


def _nibble_halves(b, p, at):
    """16 bytes at p + at holding values j (low nibble) and j + 16 (high nibble) of a 32-block."""
    qs = load_bytes(b, p, at)
    return _and(b, qs, 15), _shr(b, qs, 4)


def _with_fifth_bits(b, v, qh):
    """v (<32 x i8> nibbles) with its fifth bits: lane j gains 16 when bit j of the 32-bit qh is
    set. Those bits serve as a lane mask as they stand (one mask register on
    AVX-512, loaded straight from the block): Q5_0 products went from 12.7 to 16 GMAC/s over
    spreading each bit to its lane with vector shifts."""
    mask = b.bitcast(qh, ir.VectorType(ir.IntType(1), 32))
    return b.select(mask, b.or_(v, const_vector(I8, [16] * 32)), v)


def _q4_0(b, p):  # d:f16 qs[16]
    lo, hi = _nibble_halves(b, p, 2)
    return Block([Group(load_f16(b, p, 0), None, [lo, hi], False, 8)])


def _q4_1(b, p):  # d:f16 m:f16 qs[16]
    lo, hi = _nibble_halves(b, p, 4)
    return Block([Group(load_f16(b, p, 0), load_f16(b, p, 2), [lo, hi], False)])


def _q5(b, p, qh_at, qs_at):
    """The 32 unsigned values of a Q5_0/Q5_1 block as one <32 x i8>."""
    return _with_fifth_bits(b, concat(b, *_nibble_halves(b, p, qs_at)), load_u32(b, p, qh_at))


def _q5_0(b, p):  # d:f16 qh[4] qs[16]
    return Block([Group(load_f16(b, p, 0), None, [_q5(b, p, 2, 6)], False, 16)])


def _q5_1(b, p):  # d:f16 m:f16 qh[4] qs[16]
    return Block([Group(load_f16(b, p, 0), load_f16(b, p, 2), [_q5(b, p, 4, 8)], False)])


def _q8_0(b, p):  # d:f16 qs[32] int8
    return Block([Group(load_f16(b, p, 0), None, [load_bytes(b, p, 2, 32)], True)])


def _table_lookup(b, codes, table):
    """<16 x i8> or <32 x i8> of 4-bit codes -> table[code] (16 bytes) in one vpshufb, or None
    where the target lacks it."""
    n = codes.type.count
    shuffle = {16: ("ssse3", "llvm.x86.ssse3.pshuf.b.128"), 32: ("avx2", "llvm.x86.avx2.pshuf.b")}.get(n)
    if not shuffle or shuffle[0] not in target_features():
        return None
    return x86_call(b, shuffle[1], codes.type, [const_vector(I8, list(table) * (n // 16)), codes])


# MXFP4's values plus this offset are unsigned bytes (0..24): its products then take the unsigned
# path of Q4_0's (one vpdpbusd a word, the offset times the activations' sum taken off once a
# block), where signed bytes take two more instructions a word
FP4_OFFSET = 12


def fp4_values(b, codes):
    """<16 x i8> or <32 x i8> of 4-bit codes -> their MXFP4_VALUES + FP4_OFFSET: one vpshufb where
    the target has it, else the E2M1 arithmetic (magnitude m < 4 is itself, above it
    (2 + m % 2) * 2, doubled again from 6 on)."""
    n = codes.type.count
    looked_up = _table_lookup(b, codes, [v + FP4_OFFSET for v in MXFP4_VALUES])
    if looked_up is not None:
        return looked_up
    m = _and(b, codes, 7)

    def at_least(k):
        return b.icmp_unsigned(">=", m, const_vector(I8, [k] * n))
    wide = _shl(b, b.add(_and(b, m, 1), const_vector(I8, [2] * n)), 1)
    magnitude = b.select(at_least(4), b.select(at_least(6), _shl(b, wide, 1), wide), m)
    negative = b.icmp_unsigned("!=", _and(b, codes, 8), const_vector(I8, [0] * n))
    offset = const_vector(I8, [FP4_OFFSET] * n)
    return b.select(negative, b.sub(offset, magnitude), b.add(offset, magnitude))


def iq4_values(b, codes, plus=0):
    """<16 x i8> or <32 x i8> of 4-bit codes -> their signed IQ4_VALUES (plus `plus`, modulo 256:
    128 makes them unsigned bytes): one vpshufb where the target has it, else a comparison and a
    selection per table entry."""
    table = [(v + plus) & 0xFF for v in IQ4_VALUES]
    looked_up = _table_lookup(b, codes, table)
    if looked_up is not None:
        return looked_up
    n = codes.type.count
    values = const_vector(I8, [table[0]] * n)
    for code, value in enumerate(table[1:], 1):
        is_code = b.icmp_unsigned("==", codes, const_vector(I8, [code] * n))
        values = b.select(is_code, const_vector(I8, [value] * n), values)
    return values


def e8m0_half(b, e):
    """Half of the power of two 2^(e - 127) that E8M0 bytes e (i8 or a vector of them) encode, as
    float32 (ggml's GGML_E8M0_TO_FP32_HALF: exponent e - 1, subnormal below 2)."""
    lanes = e.type.count if isinstance(e.type, ir.VectorType) else None
    i32, f32 = (I32, F32) if lanes is None else (vector(I32, lanes), vector(F32, lanes))

    def const(v):
        return ir.Constant(i32, v if lanes is None else [v] * lanes)
    e = b.zext(e, i32)
    normal = b.shl(b.sub(e, const(1)), const(23))
    subnormal = b.shl(const(0x00200000), e)
    return b.bitcast(b.select(b.icmp_unsigned("<", e, const(2)), subnormal, normal), f32)


def _mxfp4(b, p):  # e:E8M0 qs[16]: codes j (low nibble) and j + 16 (high nibble)
    lo, hi = _nibble_halves(b, p, 1)
    scale = e8m0_half(b, b.load(b.bitcast(p, I8.as_pointer()), align=1))
    return Block([Group(scale, None, [fp4_values(b, lo), fp4_values(b, hi)], False, FP4_OFFSET)])


def _iq4_nl(b, p):  # d:f16 qs[16]: codes j (low nibble) and j + 16 (high nibble), signed values
    return Block([Group(load_f16(b, p, 0), None, [iq4_values(b, v) for v in _nibble_halves(b, p, 2)], True)])


def _iq4_xs(b, p):
    """d:f16, scales_h:u16, scales_l[4], qs[128]: eight 32-weight groups laid out as IQ4_NL's
    codes, under 6-bit scales minus 32: the low four bits of group g's in byte 4 + g // 2 (high
    nibble for odd g), the top two in bits 2g, 2g + 1 of scales_h."""
    head = load_bytes(b, p, 0)
    low = _and(b, _shr(b, _pick(b, head, [4 + g // 2 for g in range(8)]), [4 * (g % 2) for g in range(8)]), 15)
    high = _and(b, _shr(b, _pick(b, head, [2 + g // 4 for g in range(8)]), [2 * (g % 4) for g in range(8)]), 3)
    scales = _sub(b, b.zext(b.or_(low, _shl(b, high, 4)), vector(I16, 8)), 32)
    groups = [Group(None, None, [iq4_values(b, v) for v in _nibble_halves(b, p, 8 + 16 * g)], True) for g in range(8)]
    return Block(groups, load_f16(b, p, 0), scales=scales)


def _k4_groups(b, p, values):
    """Q4_K/Q5_K: eight 32-weight groups under d, dmin and the 12 bytes at p + 4 that pack their
    6-bit scales and mins: scale j < 4 is byte j & 63, min j < 4 byte j + 4 & 63; for j >= 4 the
    low four bits come from byte j + 4 (scale: its low nibble, min: its high one) and the top two
    from bits 6-7 of byte j - 4 (scale) or j (min)."""
    v = load_bytes(b, p, 4)

    def top(first):  # bits 6-7 of bytes first ... first + 3 as bits 4-5 of lanes 4-7
        return _shr(b, _and(b, _pick(b, v, [first + i % 4 for i in range(8)]), [0] * 4 + [0xC0] * 4), 2)
    scales = b.or_(_and(b, _pick(b, v, [0, 1, 2, 3, 8, 9, 10, 11]), [63] * 4 + [15] * 4), top(0))
    mins = b.or_(_and(b, _shr(b, _pick(b, v, [4, 5, 6, 7, 8, 9, 10, 11]), [0] * 4 + [4] * 4), [63] * 4 + [15] * 4),
                 top(4))
    return Block([Group(None, None, group_values, False) for group_values in values],
                 load_f16(b, p, 0), load_f16(b, p, 2), b.zext(scales, vector(I16, 8)), b.zext(mins, vector(I16, 8)))


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
            values.append([_with_bit_4(b, nibble(v), h, bit) for v, h in zip(halves, qh)])
    return _k4_groups(b, p, values)


def _with_bit_4(b, v, bits, bit):
    """v | 16 in the lanes whose byte of `bits` has bit `bit` set (a test into a mask register
    and a masked or on AVX-512, against four shifts and masks to move the bit into place)."""
    is_set = b.icmp_unsigned("!=", _and(b, bits, 1 << bit), const_vector(I8, [0] * bits.type.count))
    return b.select(is_set, b.or_(v, const_vector(I8, [16] * v.type.count)), v)


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
                value = b.or_(low, _shl(b, _bits(b, h, 2 * quarter, 3), 4))
                groups[g] = Group(None, None, [value], False, 32)
    return Block(_sixteens(groups), d, scales=b.sext(load_bytes(b, p, 192), vector(I16)))


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
    packed = load_bytes(b, p, 0)
    return Block(_two_bit_planes(b, p, 16, lambda g, half, plane, lane, v: Group(None, None, [v], False)),
                 load_f16(b, p, 80), load_f16(b, p, 82),
                 b.zext(_and(b, packed, 15), vector(I16)), b.zext(_shr(b, packed, 4), vector(I16)))


def _q3_k(b, p):  # hmask[32], qs[64], scales[12] (6-bit, packed, offset 32), d
    hmask = [load_bytes(b, p, 16 * lane) for lane in (0, 1)]

    def group(g, half, plane, lane, v):
        # a clear high-mask bit means value - 4
        return Group(None, None, [b.or_(v, _shl(b, _bits(b, hmask[lane], 4 * half + plane, 1), 2))], False, 4)
    # Scale g: low four bits from byte 96 + g % 8 (shifted by 4 for g >= 8), top two from byte
    # 104 + g % 4 (shifted by 2 * (g // 4)). The 16 bytes loaded end with the block's scales.
    packed = load_bytes(b, p, 94)
    low = _and(b, _shr(b, b.zext(_pick(b, packed, [2 + g % 8 for g in range(16)]), vector(I16)),
                       [4 * (g // 8) for g in range(16)]), 15)
    high = _and(b, _shr(b, b.zext(_pick(b, packed, [10 + g % 4 for g in range(16)]), vector(I16)),
                        [2 * (g // 4) for g in range(16)]), 3)
    scales = _sub(b, b.or_(low, _shl(b, high, 4)), 32)
    return Block(_two_bit_planes(b, p, 32, group), load_f16(b, p, 108), scales=scales)


def _u8(b, p, at):
    """The byte at p + at as an i32."""
    return b.zext(b.load(b.gep(p, [ir.Constant(I64, at)])), I32)


def _u16(b, p, at):
    return b.load(b.bitcast(offset(b, p, at), I16.as_pointer()), align=1)


def _grid_rows(b, qtype, indices):
    """The rows of the i-quant's grid (quant_types.grid: 8 or 4 values each) at `indices` (<n x
    i32>), side by side as one byte vector, from a constant of the function's module, one load a
    row: vpgatherqq and vpgatherdd ran slower than the loads (as llama.cpp's AVX2 IQ3_S kernel
    notes on Zen 4; Intel's gathers slowed further under the Downfall mitigation)."""
    rows = grid(qtype)
    word = ir.IntType(8 * rows.shape[1])
    name = f"grid_{qtype.name.lower()}"
    try:
        table = b.module.get_global(name)
    except KeyError:
        words = rows.view(np.uint64 if rows.shape[1] == 8 else np.uint32).ravel()
        table = ir.GlobalVariable(b.module, ir.ArrayType(word, len(words)), name)
        table.initializer = ir.Constant(table.value_type, [int(w) for w in words])
        table.global_constant = True
        table.linkage = "internal"
    n = indices.type.count
    words = ir.Constant(vector(word, n), ir.Undefined)
    for k in range(n):
        index = b.zext(b.extract_element(indices, ir.Constant(I32, k)), I64)
        value = b.load(b.gep(table, [ir.Constant(I64, 0), index]))
        words = b.insert_element(words, value, ir.Constant(I32, k))
    return b.bitcast(words, vector(I8, n * rows.shape[1]))


def _splat32(b, value, n):
    one = b.insert_element(ir.Constant(vector(I32, n), ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, one, const_vector(I32, [0] * n))


def negated_where(b, values, bits):
    """values (<n x i8>) negated in the lanes whose bit of `bits` (an n-bit integer) is set."""
    n = values.type.count
    mask = b.bitcast(bits, ir.VectorType(ir.IntType(1), n))
    return b.select(mask, b.sub(const_vector(I8, [0] * n), values), values)


def _sign_vector(b, fields):
    """<n x i32> of 7-bit sign fields (above bit 6 ignored) -> their sign bytes, <n x i8>: each
    field with an eighth bit that makes the byte's count of set bits even (ggml's ksigns_iq2xs,
    quant_types.sign_byte)."""
    n = fields.type.count
    v = _and(b, fields, 127)
    parity = _and(b, x86_call(b, f"llvm.ctpop.v{n}i32", v.type, [v]), 1)
    return b.trunc(b.or_(v, _shl(b, parity, 7)), vector(I8, n))


def _sign_bytes(b, fields):
    """_sign_vector's bytes side by side as one integer."""
    return b.bitcast(_sign_vector(b, fields), ir.IntType(8 * fields.type.count))


def _seven_bit_fields(b, aux):
    """The four 7-bit sign fields of a u32 (bits 0-27), as <4 x i32>."""
    return b.lshr(_splat32(b, aux, 4), const_vector(I32, [0, 7, 14, 21]))


def _bit_fields(b, word, shifts, mask):
    """(word >> shift) & mask for each shift, as <n x i32> (word: an i32)."""
    return _and(b, b.lshr(_splat32(b, word, len(shifts)), const_vector(I32, shifts)), mask)


def _halves(b, values, negative=None):
    """A <32 x i8> as the two 16-weight groups it holds: signed values, or magnitudes under the
    32 bits of `negative` (Group.negative)."""
    if negative is None:
        return [Group(None, None, [_pick(b, values, range(16 * h, 16 * h + 16))], True) for h in (0, 1)]
    return [Group(None, None, [_pick(b, values, range(16 * h, 16 * h + 16))], False,
                  negative=b.trunc(b.lshr(negative, ir.Constant(I32, 16 * h)), I16)) for h in (0, 1)]


def _odd_scales(b, scales):
    """4-bit or 3-bit scales s (i32 or i16 values) -> <n x i16> of 2s + 1: the i-quants' scale
    (s + 1/2) times a power of two that the block's d takes."""
    v = ir.Constant(vector(I16, len(scales)), ir.Undefined)
    for k, s in enumerate(scales):
        v = b.insert_element(v, b.trunc(s, I16) if s.type != I16 else s, ir.Constant(I32, k))
    return b.add(_shl(b, v, 1), const_vector(I16, [1] * len(scales)))


def _nibble_scales(b, p, at, n):
    """n 4-bit scales from n / 2 bytes at p + at (scale g in nibble g % 2 of byte g // 2) as
    i16 values."""
    return [b.and_(b.lshr(b.zext(b.load(b.gep(p, [ir.Constant(I64, at + g // 2)])), I16),
                          ir.Constant(I16, 4 * (g % 2))), ir.Constant(I16, 15)) for g in range(n)]


def _d_times(b, p, at, factor):
    return b.fmul(load_f16(b, p, at), ir.Constant(F32, factor))


def _iq2_xxs(b, p):
    """d, then per 32 weights: four grid indices (bytes) and a u32 of four 7-bit sign fields
    under a 4-bit scale s; weight = d * (s + 1/2) / 4 * grid value * sign."""
    groups, scales = [], []
    for g in range(8):
        at = 2 + 8 * g
        aux = load_u32(b, p, at + 4)
        values = _grid_rows(b, T.IQ2_XXS, b.zext(load_bytes(b, p, at, 4), vector(I32, 4)))
        groups.append(Group(None, None, [values], False, negative=_sign_bytes(b, _seven_bit_fields(b, aux))))
        scales.append(b.lshr(aux, ir.Constant(I32, 28)))
    return Block(groups, _d_times(b, p, 0, 0.125), scales=_odd_scales(b, scales))


def _iq2_xs(b, p):
    """d, qs u16[32] (per 8 weights a 9-bit grid index under a 7-bit sign field), scales[8]: a
    4-bit scale per 16 weights. Half a block's indices and signs at once (16 lanes: one vector
    operation for what four of 4 lanes took), then two groups' four entries at a time."""
    groups = []
    for half in range(2):
        qs = b.zext(b.bitcast(load_bytes(b, p, 2 + 32 * half, 32), vector(I16, 16)), vector(I32, 16))
        indices, signs = _and(b, qs, 511), _sign_vector(b, b.lshr(qs, const_vector(I32, [9] * 16)))
        for h in range(4):
            values = _grid_rows(b, T.IQ2_XS, _pick(b, indices, range(4 * h, 4 * h + 4)))
            groups += _halves(b, values, b.bitcast(_pick(b, signs, range(4 * h, 4 * h + 4)), I32))
    return Block(groups, _d_times(b, p, 0, 0.125), scales=_odd_scales(b, _nibble_scales(b, p, 66, 16)))


def _iq2_s(b, p):
    """d, qs[32] (low bytes of the 10-bit grid index of each 8 weights), signs[32] (a byte per 8
    weights), qh[8] (the indices' top two bits, 2c % 8 of byte c // 4), scales[8] (per 16). Two
    groups' four entries are gathered at once."""
    groups = []
    for h in range(8):
        tops = _shl(b, _bit_fields(b, _u8(b, p, 66 + h), [0, 2, 4, 6], 3), 8)
        indices = b.or_(b.zext(load_bytes(b, p, 2 + 4 * h, 4), vector(I32, 4)), tops)
        groups += _halves(b, _grid_rows(b, T.IQ2_S, indices), load_u32(b, p, 34 + 4 * h))
    return Block(groups, _d_times(b, p, 0, 0.125), scales=_odd_scales(b, _nibble_scales(b, p, 74, 16)))


def _iq3_xxs(b, p):
    """d, qs[64] (a grid index per 4 weights), then per 32 weights a u32 of four 7-bit sign
    fields under a 4-bit scale s; weight = d * (s + 1/2) / 2 * grid value * sign."""
    groups, scales = [], []
    for g in range(8):
        aux = load_u32(b, p, 66 + 4 * g)
        values = _grid_rows(b, T.IQ3_XXS, b.zext(load_bytes(b, p, 2 + 8 * g, 8), vector(I32, 8)))
        groups.append(Group(None, None, [values], False, negative=_sign_bytes(b, _seven_bit_fields(b, aux))))
        scales.append(b.lshr(aux, ir.Constant(I32, 28)))
    return Block(groups, _d_times(b, p, 0, 0.25), scales=_odd_scales(b, scales))


def _iq3_s(b, p):
    """d, qs[64] (low bytes of each 4 weights' 9-bit grid index), qh[8] (top bits: bit c % 8 of
    byte c // 8), signs[32] (a bit per weight), scales[4] (a 4-bit s per 32 weights: d * (2s + 1))."""
    groups = []
    for g in range(8):
        top = _u8(b, p, 66 + g)
        tops = _shl(b, _and(b, b.lshr(_splat32(b, top, 8), const_vector(I32, range(8))), 1), 8)
        indices = b.or_(b.zext(load_bytes(b, p, 2 + 8 * g, 8), vector(I32, 8)), tops)
        signs = load_u32(b, p, 74 + 4 * g)
        groups.append(Group(None, None, [_grid_rows(b, T.IQ3_S, indices)], False, negative=signs))
    return Block(groups, load_f16(b, p, 0), scales=_odd_scales(b, _nibble_scales(b, p, 106, 8)))


def _iq1_values(b, qtype, indices, negative):
    """IQ1 weights (grid values -1, 0, 1 plus a delta of +-1/8) times 8, as signed bytes: the grid
    rows at `indices` (<n x i32>), each chunk of 8 weights plus -1 where its lane of `negative`
    (<n x i1>) is set, else 1."""
    n = indices.type.count
    deltas = b.select(negative, const_vector(I8, [-1] * n), const_vector(I8, [1] * n))
    spread = _pick(b, deltas, [k for k in range(n) for _ in range(8)])
    return b.add(_shl(b, _grid_rows(b, qtype, indices), 3), spread)


def _iq1_s(b, p):
    """d, qs[32] (low bytes of each 8 weights' 11-bit grid index), qh u16[8]: per 32 weights,
    the indices' top bits (3 per 8 weights), a 3-bit scale s at bit 12, the delta's sign at 15;
    weight = d * (2s + 1) * (grid value +- 1/8)."""
    groups, scales = [], []
    for g in range(8):
        qh = b.zext(_u16(b, p, 34 + 2 * g), I32)
        indices = b.or_(b.zext(load_bytes(b, p, 2 + 4 * g, 4), vector(I32, 4)), _shl(b, _bit_fields(b, qh, [0, 3, 6, 9], 7), 8))
        negative = b.icmp_unsigned("!=", _bit_fields(b, qh, [15] * 4, 1), const_vector(I32, [0] * 4))
        groups.append(Group(None, None, [_iq1_values(b, T.IQ1_S, indices, negative)], True))
        scales.append(b.and_(b.lshr(qh, ir.Constant(I32, 12)), ir.Constant(I32, 7)))
    return Block(groups, _d_times(b, p, 0, 0.125), scales=_odd_scales(b, scales))


def _iq1_m(b, p):
    """qs[32] (as IQ1_S's), qh[16] (a nibble per 8 weights: top 3 index bits, the delta's sign),
    scales u16[4]: 3-bit scales per 16 weights in bits 0-11, the block's f16 d in their top
    nibbles (lowest first)."""
    words = [b.zext(_u16(b, p, 48 + 2 * k), I32) for k in range(4)]
    d_bits = b.or_(b.or_(b.lshr(words[0], ir.Constant(I32, 12)), b.and_(b.lshr(words[1], ir.Constant(I32, 8)), ir.Constant(I32, 0xF0))),
                   b.or_(b.and_(b.lshr(words[2], ir.Constant(I32, 4)), ir.Constant(I32, 0xF00)), b.and_(words[3], ir.Constant(I32, 0xF000))))
    d = b.fmul(b.fpext(b.bitcast(b.trunc(d_bits, I16), ir.HalfType()), F32), ir.Constant(F32, 0.125))
    groups, scales = [], []
    for h in range(8):  # (two groups of 16 at once: four chunks of 8)
        qh = b.zext(_u16(b, p, 32 + 2 * h), I32)
        indices = b.or_(b.zext(load_bytes(b, p, 4 * h, 4), vector(I32, 4)), _shl(b, _bit_fields(b, qh, [0, 4, 8, 12], 7), 8))
        negative = b.icmp_unsigned("!=", _bit_fields(b, qh, [3, 7, 11, 15], 1), const_vector(I32, [0] * 4))
        groups += _halves(b, _iq1_values(b, T.IQ1_M, indices, negative))
    for g in range(16):
        scales.append(b.and_(b.lshr(words[g // 4], ir.Constant(I32, 3 * (g % 4))), ir.Constant(I32, 7)))
    return Block(groups, d, scales=_odd_scales(b, scales))


def _trits(b, v, power):
    """Base-3 digits of TQ1_0 bytes: (v * power mod 256) * 3 >> 8, digit 0-2, per lane."""
    n = v.type.count
    shifted = b.zext(b.mul(v, const_vector(I8, [p & 0xFF for p in power] if isinstance(power, list) else [power] * n)),
                     vector(I16, n))
    return b.trunc(b.lshr(b.mul(shifted, const_vector(I16, [3] * n)), const_vector(I16, [8] * n)), vector(I8, n))


def _ones(n):
    return const_vector(I16, [1] * n)


def _tq1_0(b, p):
    """qs[48], qh[4], d: five base-3 digits per byte of qs (weight 32n + l from byte l < 32,
    then 160 + 16n + l from byte 32 + l), four per byte of qh (240 + 4n + l); weight = d * (digit - 1)."""
    head, tail = load_bytes(b, p, 0, 32), load_bytes(b, p, 32)
    qh = _pick(b, load_bytes(b, p, 48, 4), [l for n in range(4) for l in range(4)])
    pieces = [_trits(b, tail, 3 ** n) for n in range(5)] + [_trits(b, qh, [3 ** n for n in range(4) for _ in range(4)])]
    groups = [Group(None, None, [_trits(b, head, 3 ** n)], False, 1) for n in range(5)]
    groups += [Group(None, None, pieces[2 * k:2 * k + 2], False, 1) for k in range(3)]
    return Block(groups, load_f16(b, p, 52), scales=_ones(8))


def _tq2_0(b, p):
    """qs[64], d: weight 128h + 32j + l in bits 2j of byte 32h + l, weight = d * (value - 1)."""
    groups = [Group(None, None, [_bits(b, load_bytes(b, p, 32 * h, 32), 2 * j, 3)], False, 1)
              for h in (0, 1) for j in range(4)]
    return Block(groups, load_f16(b, p, 64), scales=_ones(8))


DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.MXFP4: _mxfp4,
            T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
            T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ2_XXS: _iq2_xxs,
            T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0}
# Where the 32-weight affine types keep their float16 min m (weight = d * q + m) in a block: the
# dot products read the mins of a row from a copy of them laid side by side (see rowdot.py).
MIN_OFFSET = {T.Q4_1: 2, T.Q5_1: 2}
