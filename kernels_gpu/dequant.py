"""GGUF blocks to float32 in torch: one function per block layout.

Each decoder takes raw rows (N, bytes per row) uint8 and returns (N, weights per row) float32.
They are written with element-wise torch ops only (slices, shifts, masks, stack, broadcasting),
so that torch.compile can fuse a decoder into the product that consumes it (on CUDA, where no
Triton decoder of triton_blocks.py serves the type). Run eagerly, the same functions are the
products' path on torch's CPU device and the reference of the GPU kernels.

Layouts follow ggml's block structs; `_weights` puts the pieces back in ggml's element order.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gguf_io.quant_types import GRID_TYPES, IQ4_VALUES, MXFP4_VALUES, grid, sign_byte


def _blocks(raw: torch.Tensor, qtype) -> torch.Tensor:
    """(N, row bytes) -> (N, blocks per row, block bytes)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 at b[..., 0:2] as int32."""
    return b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 at b[..., 0:4] as int64."""
    return sum(b[..., i].to(torch.int64) << 8 * i for i in range(4))


def _half(bits: torch.Tensor) -> torch.Tensor:
    """float16 bit patterns (int32) as float32, through int16 (a same-size bitcast, which
    torch.compile fuses; viewing uint8 pairs as float16 would need a copy)."""
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 at b[..., 0:2] as float32."""
    return _half(_u16(b))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2, n): low nibbles, then high nibbles (ggml's order in a block)."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def _bits(byte: torch.Tensor, shifts: range, width: int = 1, dim: int = -2) -> torch.Tensor:
    """(..., n) -> (..., len(shifts), n) (dim=-1: (..., n, len(shifts))): the `width`-bit fields
    of each byte (or wider integer) at those shifts."""
    mask = (1 << width) - 1
    return torch.stack([(byte >> s) & mask for s in shifts], dim=dim)


def _weights(values: torch.Tensor, n_rows: int) -> torch.Tensor:
    return values.reshape(n_rows, -1)


def q4_0(raw):
    b = _blocks(raw, T.Q4_0)
    q = _nibbles(b[..., 2:18]).to(torch.float32) - 8.0                   # (N, nb, 2, 16)
    return _weights(_f16(b[..., 0:2])[..., None, None] * q, raw.shape[0])


def q4_1(raw):
    b = _blocks(raw, T.Q4_1)
    q = _nibbles(b[..., 4:20]).to(torch.float32)
    return _weights(_f16(b[..., 0:2])[..., None, None] * q + _f16(b[..., 2:4])[..., None, None], raw.shape[0])


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: bit j of the 32-bit qh is the fifth bit of weight j -> (N, nb, 2, 16)."""
    bits = _bits(qh, range(8))                                            # (N, nb, 8 bits, 4 bytes)
    return bits.transpose(-1, -2).reshape(*qh.shape[:-1], 2, 16)         # weight j = 8 * byte + bit


def q5_0(raw):
    b = _blocks(raw, T.Q5_0)
    q = (_nibbles(b[..., 6:22]) | (_fifth_bits(b[..., 2:6]) << 4)).to(torch.float32) - 16.0
    return _weights(_f16(b[..., 0:2])[..., None, None] * q, raw.shape[0])


def q5_1(raw):
    b = _blocks(raw, T.Q5_1)
    q = (_nibbles(b[..., 8:24]) | (_fifth_bits(b[..., 4:8]) << 4)).to(torch.float32)
    return _weights(_f16(b[..., 0:2])[..., None, None] * q + _f16(b[..., 2:4])[..., None, None], raw.shape[0])


def q8_0(raw):
    b = _blocks(raw, T.Q8_0)
    q = b[..., 2:34].view(torch.int8).to(torch.float32)
    return _weights(_f16(b[..., 0:2])[..., None] * q, raw.shape[0])


def mxfp4(raw):
    """E8M0 scale e, 16 bytes of 4-bit E2M1 codes (low nibbles first): weight = code's value *
    2^(e - 127), the values doubled in the table and the scale halved, as ggml writes them."""
    b = _blocks(raw, T.MXFP4)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=raw.device)[_nibbles(b[..., 1:17]).long()]
    e = b[..., 0].to(torch.int32)
    half_scale = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    return _weights(half_scale[..., None, None] * values, raw.shape[0])


def _iq4(codes):
    """4-bit codes -> their IQ4_VALUES as float32."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def iq4_nl(raw):  # d, qs[16]: Q4_0's nibbles, as codes of IQ4_VALUES
    b = _blocks(raw, T.IQ4_NL)
    return _weights(_f16(b[..., 0:2])[..., None, None] * _iq4(_nibbles(b[..., 2:18])), raw.shape[0])


def iq4_xs(raw):
    """d, scales_h (u16), scales_l[4], qs[128]: eight IQ4_NL blocks' codes under 6-bit scales
    minus 32 (low four bits: nibble g % 2 of scales_l[g // 2]; top two: bits 2g of scales_h)."""
    b = _blocks(raw, T.IQ4_XS)
    low = _nibbles(b[..., 4:8]).transpose(-1, -2).reshape(*b.shape[:2], 8)
    high = _bits(b[..., 2:4], range(0, 8, 2), 2).transpose(-1, -2).reshape(*b.shape[:2], 8)
    scales = (low | (high << 4)).to(torch.int32) - 32
    q = _iq4(_nibbles(b[..., 8:136].reshape(*b.shape[:2], 8, 16)))            # (N, nb, 8, 2, 16)
    return _weights(_scaled(_f16(b[..., 0:2]), scales, q, 32), raw.shape[0])


def _scaled(d, scales, q, group):
    """d * scales[g] * q over consecutive groups of `group` weights: q is (N, nb, 256)."""
    q = q.reshape(*q.shape[:2], -1, group)
    return d[..., None, None] * scales[..., None].to(torch.float32) * q


def q2_k(raw):  # scales[16] (scale | min << 4), qs[64], d, dmin
    b = _blocks(raw, T.Q2_K)
    sc = b[..., 0:16]
    # two halves of 128 weights, each four 2-bit planes of the same 32 bytes
    q = _bits(b[..., 16:80].reshape(*b.shape[:2], 2, 32), range(0, 8, 2), 2).to(torch.float32)
    w = _scaled(_f16(b[..., 80:82]), sc & 0xF, q, 16)
    w = w - _f16(b[..., 82:84])[..., None, None] * (sc >> 4)[..., None].to(torch.float32)
    return _weights(w, raw.shape[0])


def q3_k(raw):  # hmask[32], qs[64], scales[12] (16 six-bit scales), d
    b = _blocks(raw, T.Q3_K)
    s = b[..., 96:108]
    low = torch.cat([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], dim=-1)               # scale i < 8: byte i
    high = _bits(s[..., 8:12], range(0, 8, 2), 2).reshape(*s.shape[:-1], 16)     # 2 bits of byte 8 + i % 4
    scales = (low | (high << 4)).to(torch.int32) - 32
    q = _bits(b[..., 32:96].reshape(*b.shape[:2], 2, 32), range(0, 8, 2), 2)     # (N, nb, 2, 4, 32)
    h = _bits(b[..., 0:32], range(8)).reshape(*b.shape[:2], 2, 4, 32)            # plane 4n + j's high bit
    q = (q.to(torch.int32) + 4 * h.to(torch.int32) - 4).to(torch.float32)
    return _weights(_scaled(_f16(b[..., 108:110]), scales, q, 16), raw.shape[0])


def _k4_scales(s):
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes."""
    scales = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return scales, mins


def _k4_weights(b, q, n_rows):
    scales, mins = _k4_scales(b[..., 4:16])
    w = _scaled(_f16(b[..., 0:2]), scales, q, 32)
    return _weights(w - _f16(b[..., 2:4])[..., None, None] * mins[..., None].to(torch.float32), n_rows)


def q4_k(raw):  # d, dmin, scales[12], qs[128]: four chunks of 32 bytes, low nibbles then high
    b = _blocks(raw, T.Q4_K)
    q = _nibbles(b[..., 16:144].reshape(*b.shape[:2], 4, 32)).to(torch.float32)
    return _k4_weights(b, q, raw.shape[0])


def q5_k(raw):  # d, dmin, scales[12], qh[32], qs[128]; sub-block j's fifth bit is bit j of qh
    b = _blocks(raw, T.Q5_K)
    high = _bits(b[..., 16:48], range(8)).reshape(*b.shape[:2], 4, 2, 32)
    q = (_nibbles(b[..., 48:176].reshape(*b.shape[:2], 4, 32)) | (high << 4)).to(torch.float32)
    return _k4_weights(b, q, raw.shape[0])


def q6_k(raw):  # ql[128], qh[64], scales[16] int8, d
    b = _blocks(raw, T.Q6_K)
    # each half of 128 weights: 64 ql bytes (low nibbles of 0..63, high nibbles of 64..127) and
    # 32 qh bytes holding 2-bit planes for the four runs of 32
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 2, 32)                    # (half, byte run, 32)
    low = torch.stack([ql & 0xF, ql >> 4], dim=-3).reshape(*b.shape[:2], 2, 4, 32)  # lo0, lo1, hi0, hi1
    high = _bits(b[..., 128:192].reshape(*b.shape[:2], 2, 32), range(0, 8, 2), 2)
    q = ((low | (high << 4)).to(torch.int32) - 32).to(torch.float32)
    scales = b[..., 192:208].view(torch.int8)
    return _weights(_scaled(_f16(b[..., 208:210]), scales, q, 16), raw.shape[0])


# ---- ternary types: weights -1, 0, 1 times the block's d ----

def _trits(qs: torch.Tensor, n: int) -> torch.Tensor:
    """(..., m) bytes -> (..., n, m): base-3 digit j of each byte, as -1, 0 or 1 (ggml stores
    the fraction value / 3^5 rounded up: multiplying by 3^j, wrapping at 256, brings digit j to
    the top, and * 3 >> 8 reads it)."""
    q = torch.stack([(qs.to(torch.int32) * 3 ** j) & 0xFF for j in range(n)], dim=-2)
    return ((q * 3) >> 8) - 1


def tq1_0(raw):
    """qs[48], qh[4], d: five digits in each of qs[0:32] (weights 32j + byte), five in each of
    qs[32:48] (160 + 16j + byte), four in each of qh (240 + 4j + byte)."""
    b = _blocks(raw, T.TQ1_0)
    n, nb = b.shape[:2]
    q = torch.cat([_trits(b[..., 0:32], 5).reshape(n, nb, 160), _trits(b[..., 32:48], 5).reshape(n, nb, 80),
                   _trits(b[..., 48:52], 4).reshape(n, nb, 16)], dim=-1)
    return _weights(_f16(b[..., 52:54])[..., None] * q.to(torch.float32), n)


def tq2_0(raw):  # qs[64], d: two runs of 32 bytes, each four 2-bit planes of value + 1
    b = _blocks(raw, T.TQ2_0)
    q = _bits(b[..., 0:64].reshape(*b.shape[:2], 2, 32), range(0, 8, 2), 2).to(torch.float32) - 1.0
    return _weights(_f16(b[..., 64:66])[..., None, None, None] * q, raw.shape[0])


# ---- grid i-quants: groups of 8 (IQ3: 4) weights are an index into the type's grid of values ----

# The tables on the host, built at import (torch.compile traces the decoders, not numpy), and
# their copies on each device.
_HOST_TABLES = {qtype: torch.from_numpy(grid(qtype)).to(torch.float32) for qtype in GRID_TYPES}
# ggml's ksigns_iq2xs as signs: row i is +-1 by the bits of sign_byte(i)
_HOST_TABLES["ksigns"] = torch.tensor([[-1.0 if sign_byte(i) >> j & 1 else 1.0 for j in range(8)]
                                       for i in range(128)])
# the grids' bytes as gguf_io holds them, for triton_blocks' decoders
_HOST_TABLES.update({("bytes", qtype): torch.from_numpy(grid(qtype).view(np.uint8).ravel().copy())
                     for qtype in GRID_TYPES})
_DEVICE_TABLES = {}


def tables(device: torch.device) -> dict:
    """The decoders' lookup tables on the device, copied there once. QuantMatrix calls it as it
    takes rows on a device, before torch.compile traces a decoder there: a trace that copied
    them would recompile once they exist, and might be recorded into a CUDA graph."""
    on_device = _DEVICE_TABLES.get(device)
    if on_device is None:
        on_device = _DEVICE_TABLES[device] = {key: t.to(device) for key, t in _HOST_TABLES.items()}
    return on_device


def _table(key, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of a table (a grid's key is its type): (...) -> (..., row length) float32."""
    return tables(index.device)[key][index.long()]


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (...) -> (..., 8) of +-1: the bits of ggml's ksigns_iq2xs[index]."""
    return _table("ksigns", index)


def _signs(byte: torch.Tensor) -> torch.Tensor:
    """Sign bytes (...) -> (..., 8) of +-1: bit j set is weight j negative."""
    return 1.0 - 2.0 * _bits(byte, range(8), dim=-1).to(torch.float32)


def _iq_scale(d, s, step):
    """d * (0.5 + s) * step, the IQ2 and IQ3_XXS sub-block scales, in gguf's float32 order."""
    return d[..., None] * (0.5 + s.to(torch.float32)) * step


def iq2_xxs(raw):
    """d, then per 32 weights 8 bytes: 4 grid indices, and a u32 of four 7-bit sign indices
    (ksigns) under a 4-bit scale s in its top bits: weight = d * (0.5 + s) / 4 * grid * sign."""
    b = _blocks(raw, T.IQ2_XXS)
    q = b[..., 2:66].reshape(*b.shape[:2], 8, 8)
    aux = _u32(q[..., 4:8])                                                   # (N, nb, 8)
    values = _table(T.IQ2_XXS, q[..., 0:4]) * _ksigns(_bits(aux, range(0, 28, 7), 7, dim=-1))
    return _weights(_iq_scale(_f16(b[..., 0:2]), aux >> 28, 0.25)[..., None, None] * values, raw.shape[0])


def iq2_xs(raw):
    """d, qs u16[32] (a 9-bit grid index under a 7-bit sign index, per 8 weights), scales[8]
    (4-bit scales per 16 weights, low nibbles first)."""
    b = _blocks(raw, T.IQ2_XS)
    n, nb = b.shape[:2]
    qs = _u16(b[..., 2:66].reshape(n, nb, 32, 2))
    values = (_table(T.IQ2_XS, qs & 511) * _ksigns(qs >> 9)).reshape(n, nb, 16, 16)
    scales = _nibbles(b[..., 66:74]).transpose(-1, -2).reshape(n, nb, 16)
    return _weights(_iq_scale(_f16(b[..., 0:2]), scales, 0.25)[..., None] * values, n)


def iq2_s(raw):
    """d, qs[32] (grid index low bits per 8 weights), signs[32] (a byte per 8 weights), qh[8]
    (index bits 8-9: 2 bits of qh[g // 4] at 2 (g % 4)), scales[8] (as IQ2_XS)."""
    b = _blocks(raw, T.IQ2_S)
    n, nb = b.shape[:2]
    high = _bits(b[..., 66:74], range(0, 8, 2), 2, dim=-1).reshape(n, nb, 32)
    index = b[..., 2:34].to(torch.int32) | (high.to(torch.int32) << 8)
    values = (_table(T.IQ2_S, index) * _signs(b[..., 34:66])).reshape(n, nb, 16, 16)
    scales = _nibbles(b[..., 74:82]).transpose(-1, -2).reshape(n, nb, 16)
    return _weights(_iq_scale(_f16(b[..., 0:2]), scales, 0.25)[..., None] * values, n)


def iq3_xxs(raw):
    """d, qs[64] (grid indices of 4 weights), then per 32 weights a u32 of four 7-bit sign indices
    under a 4-bit scale s: weight = d * (0.5 + s) / 2 * grid * sign."""
    b = _blocks(raw, T.IQ3_XXS)
    n, nb = b.shape[:2]
    aux = _u32(b[..., 66:98].reshape(n, nb, 8, 4))                            # (N, nb, 8)
    values = _table(T.IQ3_XXS, b[..., 2:66]).reshape(n, nb, 8, 4, 8)
    values = values * _ksigns(_bits(aux, range(0, 28, 7), 7, dim=-1))
    return _weights(_iq_scale(_f16(b[..., 0:2]), aux >> 28, 0.5)[..., None, None] * values, n)


def iq3_s(raw):
    """d, qs[64] (grid index low bits per 4 weights), qh[8] (bit 8 of index 8j + i: bit i of
    qh[j]), signs[32] (a byte per 8 weights), scales[4] (4-bit s per 32 weights, low nibbles
    first): weight = d * (1 + 2s) * grid * sign."""
    b = _blocks(raw, T.IQ3_S)
    n, nb = b.shape[:2]
    high = _bits(b[..., 66:74], range(8), dim=-1).reshape(n, nb, 64)
    index = b[..., 2:66].to(torch.int32) | (high.to(torch.int32) << 8)
    values = (_table(T.IQ3_S, index).reshape(n, nb, 32, 8) * _signs(b[..., 74:106])).reshape(n, nb, 8, 32)
    scales = _nibbles(b[..., 106:110]).transpose(-1, -2).reshape(n, nb, 8).to(torch.int32)
    db = _f16(b[..., 0:2])[..., None] * (1 + 2 * scales).to(torch.float32)
    return _weights(db[..., None] * values, n)


def _iq1(dl, index, delta_bit, qtype):
    """dl * (grid + delta): IQ1's weights, delta -1/8 where delta_bit is set, else 1/8."""
    delta = 0.125 - 0.25 * (delta_bit != 0).to(torch.float32)
    return dl * (_table(qtype, index) + delta[..., None])


def iq1_s(raw):
    """d, qs[32] (grid index low bytes per 8 weights), qh u16[8] per 32 weights: bits 3l..3l+2
    the index's bits 8-10 of group l, bits 12-14 a scale s, bit 15 the sign of delta:
    weight = d * (2s + 1) * (grid + delta)."""
    b = _blocks(raw, T.IQ1_S)
    n, nb = b.shape[:2]
    qh = _u16(b[..., 34:50].reshape(n, nb, 8, 2))                             # (N, nb, 8)
    index = b[..., 2:34].reshape(n, nb, 8, 4).to(torch.int32) | (_bits(qh, range(0, 12, 3), 3, dim=-1) << 8)
    dl = _f16(b[..., 0:2])[..., None] * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    return _weights(_iq1(dl[..., None, None], index, (qh & 0x8000)[..., None], T.IQ1_S), n)


def iq1_m(raw):
    """qs[32] (grid index low bytes per 8 weights), qh[16] (a nibble per 8 weights, low first:
    the index's bits 8-10, then the sign of delta), scales u16[4]: four 3-bit scales s per 16
    weights in bits 0-11 of each, and the block's float16 d in their top nibbles (first word's
    lowest): weight = d * (2s + 1) * (grid + delta)."""
    b = _blocks(raw, T.IQ1_M)
    n, nb = b.shape[:2]
    sc = _u16(b[..., 48:56].reshape(n, nb, 4, 2))                             # (N, nb, 4)
    d = _half(sum(((sc[..., i] >> 12) & 0xF) << 4 * i for i in range(4)))
    scales = _bits(sc, range(0, 12, 3), 3, dim=-1).reshape(n, nb, 16)
    dl = d[..., None] * (2 * scales + 1).to(torch.float32)
    codes = _nibbles(b[..., 32:48]).transpose(-1, -2).reshape(n, nb, 16, 2)
    index = b[..., 0:32].reshape(n, nb, 16, 2).to(torch.int32) | ((codes.to(torch.int32) & 7) << 8)
    return _weights(_iq1(dl[..., None, None], index, codes & 8, T.IQ1_M), n)


def f32(raw):
    return raw.view(torch.float32)


def f16(raw):
    return raw.view(torch.float16).to(torch.float32)


def bf16(raw):
    return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


DEQUANTIZE = {T.F32: f32, T.F16: f16, T.BF16: bf16, T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0,
              T.Q5_1: q5_1, T.Q8_0: q8_0, T.MXFP4: mxfp4, T.Q2_K: q2_k, T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k,
              T.Q6_K: q6_k, T.IQ4_NL: iq4_nl, T.IQ4_XS: iq4_xs, T.IQ1_S: iq1_s, T.IQ1_M: iq1_m,
              T.IQ2_XXS: iq2_xxs, T.IQ2_XS: iq2_xs, T.IQ2_S: iq2_s, T.IQ3_XXS: iq3_xxs, T.IQ3_S: iq3_s,
              T.TQ1_0: tq1_0, T.TQ2_0: tq2_0}
