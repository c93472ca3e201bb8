"""GGUF blocks to float32 in torch: one function per block layout.

Each decoder takes raw rows (N, bytes per row) uint8 and returns (N, weights per row) float32.
They are written with element-wise torch ops only (slices, shifts, masks, stack, broadcasting),
so that torch.compile can fuse a decoder into the product that consumes it (on CUDA, where no
Triton decoder of triton_blocks.py serves the type). Run eagerly, the same functions are the
products' path on torch's CPU device and the reference of the GPU kernels.

Layouts follow ggml's block structs; `_weights` puts the pieces back in ggml's element order.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gguf_io.quant_types import IQ4_VALUES, MXFP4_VALUES


def _blocks(raw: torch.Tensor, qtype) -> torch.Tensor:
    """(N, row bytes) -> (N, blocks per row, block bytes)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 at b[..., 0:2] as float32, through an int16 bit pattern (a same-size
    bitcast, which torch.compile fuses; viewing uint8 pairs as float16 would need a copy)."""
    bits = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2, n): low nibbles, then high nibbles (ggml's order in a block)."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def _bits(byte: torch.Tensor, shifts: range, width: int = 1) -> torch.Tensor:
    """(..., n) -> (..., len(shifts), n): the `width`-bit fields of each byte at those shifts."""
    mask = (1 << width) - 1
    return torch.stack([(byte >> s) & mask for s in shifts], dim=-2)


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


def f32(raw):
    return raw.view(torch.float32)


def f16(raw):
    return raw.view(torch.float16).to(torch.float32)


def bf16(raw):
    return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


DEQUANTIZE = {T.F32: f32, T.F16: f16, T.BF16: bf16, T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0,
              T.Q5_1: q5_1, T.Q8_0: q8_0, T.MXFP4: mxfp4, T.Q2_K: q2_k, T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k,
              T.Q6_K: q6_k, T.IQ4_NL: iq4_nl, T.IQ4_XS: iq4_xs}
