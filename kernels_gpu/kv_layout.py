"""How the torch backend's KV cache holds keys (kv heads, dim, slots) and values (kv heads, slots,
dim): float32, float16, or q8_0 as llama.cpp's -ctk/-ctv q8_0.

q8_0 keeps blocks of QBLOCK values along the head dimension as int8 with a float16 scale
d = max|x| / 127, quantized exactly as the CPU backend (kernels_cpu/kv_layout.py) and llama.cpp's
reference Q8_0 do. As on the CPU, the int8 sit where float elements would and the blocks' scales
follow them as byte pairs along the head dimension: keys (kv heads, dim + 2 * blocks, slots),
values (kv heads, slots, dim + 2 * blocks). Attention reads the blocks back as float32, with ops
that need no host round trip (a CUDA graph can hold them).
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QBLOCK, QBLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
ELEMENTS = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.int8}


def new_kv(n_kv: int, key_dim: int, value_dim: int, slots: int, kv_type: str, device):
    if kv_type == "q8_0":
        if key_dim % QBLOCK or value_dim % QBLOCK:
            raise ValueError(f"a q8_0 KV cache needs head sizes that are multiples of {QBLOCK}, "
                             f"not {key_dim} and {value_dim}")
        key_dim, value_dim = _stored(key_dim), _stored(value_dim)
    zeros = dict(dtype=ELEMENTS[kv_type], device=device)
    return torch.zeros((n_kv, key_dim, slots), **zeros), torch.zeros((n_kv, slots, value_dim), **zeros)


def store_kv(keys, values, slots, k, v):
    """k[t] (kv heads, dim) into keys[:, :, slots[t]] and v[t] into values[:, slots[t]]."""
    if keys.dtype == torch.int8:
        k, v = _quantize(k), _quantize(v)
    keys.index_copy_(2, slots, k.permute(1, 2, 0).to(keys.dtype))
    values.index_copy_(1, slots, v.permute(1, 0, 2).to(values.dtype))


def export_rows(keys, values, slots):
    """The slots' contents exactly as stored, as (kv heads, len(slots), width): the layout of
    snapshots on every backend (kernels_cpu.kv_layout.export_rows), here the keys transposed."""
    return keys[:, :, slots].transpose(1, 2), values[:, slots]


def import_rows(keys, values, slots, key_rows, value_rows):
    """export_rows' arrays (as tensors on the cache's device) back into the slots."""
    keys[:, :, slots] = key_rows.transpose(1, 2)
    values[:, slots] = value_rows


def keys_f32(keys, n: int):
    """Slots 0..n-1 of the keys as float32 (kv heads, dim, n)."""
    return _dequantize(keys[:, :, :n], 1) if keys.dtype == torch.int8 else keys[:, :, :n].to(torch.float32)


def values_f32(values, n: int):
    """Slots 0..n-1 of the values as float32 (kv heads, n, dim)."""
    return _dequantize(values[:, :n], 2) if values.dtype == torch.int8 else values[:, :n].to(torch.float32)


def _stored(dim: int) -> int:
    return dim // QBLOCK * QBLOCK_BYTES


def _quantize(x):
    """(..., dim) float32 -> (..., dim + 2 * blocks) int8: each block's integers as llama.cpp's
    quantize_row_q8_0_ref rounds them, then the blocks' float16 scales, little-endian bytes."""
    blocks = x.to(torch.float32).unflatten(-1, (-1, QBLOCK))
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    y = blocks * torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    # C's roundf, exactly: the whole part, + 1 when the fraction is at least 1/2; the sign back on
    a = y.abs()
    whole = a.floor()
    ints = (torch.sign(y) * (whole + (2.0 * (a - whole)).floor())).to(torch.int8).flatten(-2)
    bits = d.to(torch.float16).view(torch.int16).to(torch.int32).squeeze(-1)
    scale_bytes = torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8).view(torch.int8)
    return torch.cat([ints, scale_bytes.flatten(-2)], dim=-1)


def _dequantize(stored, axis: int):
    """int8 blocks and their scales along `axis` (see _quantize) -> float32 values."""
    stored = stored.movedim(axis, -1)
    dim = stored.shape[-1] * QBLOCK // QBLOCK_BYTES
    scale_bytes = stored[..., dim:].to(torch.int32) & 0xFF
    bits = (scale_bytes[..., 0::2] | (scale_bytes[..., 1::2] << 8)).to(torch.int16)
    scales = bits.view(torch.float16).to(torch.float32)
    values = stored[..., :dim].to(torch.float32) * scales.repeat_interleave(QBLOCK, dim=-1)
    return values.movedim(-1, axis)
