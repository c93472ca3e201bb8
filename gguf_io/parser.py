"""Bounds-checked parse of a GGUF header: metadata key/values and the tensor table.

gguf.GGUFReader walks every array element in Python (3.7 s for SmolLM2's vocabulary, 19 s for
Gemma 3's) and spins forever on a scalar array whose count runs past the end of the file, so the
header is parsed here instead, with the format's constants from the `gguf` package. Every length
and count is checked against the bytes that remain before it is used, so a hostile header can
neither allocate gigabytes nor loop for long.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from .errors import GGUFError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_NESTING = 4
MAX_TENSOR_NAME = 64   # bytes, as ggml's GGML_MAX_NAME: llama.cpp refuses longer names too
MAX_KEY = 256          # bytes of a metadata key; real keys are a few dozen
SHOWN_NAME = 100       # characters of a name quoted in an error


def shown(name: str) -> str:
    """A name from the file as an error quotes it: repr, cut to SHOWN_NAME characters."""
    return repr(name) if len(name) <= SHOWN_NAME else repr(name[:SHOWN_NAME]) + f"... ({len(name)} characters)"

_SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("<u1"),
}


@dataclass(frozen=True)
class MetadataValue:
    """A metadata value with its GGUF type; arrays keep their element type in `item_type`."""

    type: GGUFValueType
    value: object
    item_type: GGUFValueType | None = None


def ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGML shape as ggml counts its dimensions (ggml_n_dims): trailing 1s do not count, so
    [n, 1] is [n]."""
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return tuple(shape)


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table. `shape` is in GGML order: shape[0] is the row length."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute position of the first byte in the file
    nbytes: int
    part: int = 0  # the file of a split model that holds it (GGUFFile.parts)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.n_rows


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, MetadataValue]
    tensors: dict[str, TensorInfo]
    data_offset: int
    alignment: int


class _Cursor:
    """Reads little-endian values from a buffer, raising GGUFError instead of running off its end."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"file is truncated: {what} at byte {self.pos} needs {n} bytes, "
                            f"only {self.size - self.pos} remain")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def string(self, what: str, max_length: int | None = None) -> str:
        length = self.unpack("<Q", what + " length")
        if max_length is not None and length > max_length:
            raise GGUFError(f"file is corrupt: a {what} of {length} bytes at byte {self.pos - 8} "
                            f"(at most {max_length} allowed)")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        # llama.cpp keeps invalid UTF-8 vocabulary entries as raw bytes; replacement keeps them usable.
        return raw.decode("utf-8", errors="replace")

    def strings(self, n: int, what: str) -> list[str]:
        """n consecutive strings: the vocabulary's tokens and merges, so this loop is kept lean.
        The first string that runs past the end is read again by `string`, which says how."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack_length = struct.Struct("<Q").unpack_from
        try:
            for _ in range(n):
                end = pos + 8 + unpack_length(buf, pos)[0]
                if end > size:
                    break
                out.append(str(buf[pos + 8:end], "utf-8", "replace"))  # as `string` decodes
                pos = end
        except struct.error:  # the length itself runs past the end
            pass
        self.pos = pos
        if len(out) < n:
            self.string(what)  # raises the truncation error
        return out

    def count(self, min_item_bytes: int, what: str) -> int:
        n = self.unpack("<Q", what + " count")
        if n * min_item_bytes > self.size - self.pos:
            raise GGUFError(f"file is truncated or corrupt: {what} claims {n} items, "
                            f"more than the {self.size - self.pos} bytes left in the file")
        return n


def _value_type(raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"metadata key {shown(key)} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> MetadataValue:
    if vtype == GGUFValueType.STRING:
        return MetadataValue(vtype, cur.string(f"metadata {shown(key)}"))
    if vtype in _SCALARS:
        dtype = _SCALARS[vtype]
        cur.need(dtype.itemsize, f"metadata {shown(key)}")
        value = np.frombuffer(cur.buf, dtype, 1, cur.pos)[0].item()
        cur.pos += dtype.itemsize
        return MetadataValue(vtype, bool(value) if vtype == GGUFValueType.BOOL else value)
    if vtype != GGUFValueType.ARRAY:
        raise GGUFError(f"metadata key {shown(key)} has unhandled value type {vtype.name}")
    if depth >= MAX_NESTING:
        raise GGUFError(f"metadata key {shown(key)} nests arrays deeper than {MAX_NESTING}")
    item_type = _value_type(cur.unpack("<I", f"metadata {shown(key)} item type"), key)
    if item_type in _SCALARS:
        dtype = _SCALARS[item_type]
        n = cur.count(dtype.itemsize, f"metadata array {shown(key)}")
        # Zero-copy view into the mapped file: vocabulary scores and types are large.
        items = np.frombuffer(cur.buf, dtype, n, cur.pos)
        cur.pos += n * dtype.itemsize
        if item_type == GGUFValueType.BOOL:
            items = items.astype(bool)
        return MetadataValue(vtype, items, item_type)
    if item_type == GGUFValueType.STRING:
        n = cur.count(8, f"metadata array {shown(key)}")
        return MetadataValue(vtype, cur.strings(n, f"metadata {shown(key)} item"), item_type)
    n = cur.count(12, f"metadata array {shown(key)}")  # a nested array is at least its type and count
    return MetadataValue(vtype, [_read_value(cur, item_type, key, depth + 1).value for _ in range(n)], item_type)


def _read_tensor_info(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string("tensor name", MAX_TENSOR_NAME)
    n_dims = cur.unpack("<I", f"tensor {shown(name)} dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"tensor {shown(name)} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    cur.need(8 * n_dims, f"tensor {shown(name)} shape")
    shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    raw_type = cur.unpack("<I", f"tensor {shown(name)} type")
    rel_offset = cur.unpack("<Q", f"tensor {shown(name)} offset")
    return name, raw_type, shape, rel_offset


def _tensor_type(raw: int, name: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(raw)
    except ValueError:
        raise GGUFError(f"tensor {shown(name)} has unknown type id {raw}") from None


def parse_header(buf, size: int) -> Header:
    """Parse and validate everything before the tensor data. `buf` supports the buffer protocol."""
    cur = _Cursor(buf, size)
    if size < 4 or cur.unpack("<I", "magic") != GGUF_MAGIC:
        raise GGUFError("not a GGUF file (bad magic)")
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.count(24, "tensor table")  # name length, dims, type, offset: 24 bytes at least
    n_kv = cur.count(12, "metadata")

    metadata: dict[str, MetadataValue] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key", MAX_KEY)
        vtype = _value_type(cur.unpack("<I", f"metadata {shown(key)} type"), key)
        if key in metadata:
            raise GGUFError(f"metadata key {shown(key)} appears twice")
        metadata[key] = _read_value(cur, vtype, key)

    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"].value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment!r} is not a power of two")

    raw_tensors = [_read_tensor_info(cur) for _ in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, raw_type, shape, rel_offset in raw_tensors:
        if name in tensors:
            raise GGUFError(f"tensor {shown(name)} appears twice")
        tensors[name] = _checked_tensor(name, raw_type, shape, rel_offset, data_offset, alignment, size)
    _check_no_overlap(tensors.values())
    return Header(version, metadata, tensors, data_offset, alignment)


def _checked_tensor(name, raw_type, shape, rel_offset, data_offset, alignment, size) -> TensorInfo:
    ttype = _tensor_type(raw_type, name)
    if any(d == 0 for d in shape) or any(d >= 2**40 for d in shape):
        raise GGUFError(f"tensor {shown(name)} has an invalid shape {list(shape)}")
    block, block_bytes = GGML_QUANT_SIZES[ttype]
    if shape[0] % block:
        raise GGUFError(f"tensor {shown(name)}: row length {shape[0]} is not a multiple of the "
                        f"{ttype.name} block size {block}")
    n_elements = 1
    for d in shape:
        n_elements *= d
    nbytes = n_elements // block * block_bytes
    if rel_offset % alignment:
        raise GGUFError(f"tensor {shown(name)} offset {rel_offset} is not aligned to {alignment}")
    offset = data_offset + rel_offset
    if offset + nbytes > size:
        raise GGUFError(f"tensor {shown(name)} extends past the end of the file "
                        f"(needs bytes {offset}..{offset + nbytes}, file has {size}); truncated?")
    return TensorInfo(name, ttype, tuple(int(d) for d in shape), offset, nbytes)


def _check_no_overlap(tensors) -> None:
    previous = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise GGUFError(f"tensors {previous.name!r} and {t.name!r} overlap in the file")
        previous = t
