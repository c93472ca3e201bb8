"""How the KV cache holds keys and values, in each element type; writing tokens into it and reading
it back as float32 (decode attention reads it in place: intrinsics.cache_product).

Values are (kv heads, slots, dim); keys are tiled by slots, (kv heads, slots / KEY_TILE, dim,
KEY_TILE), so that a query's scores run along slots in vector lanes and one slot's key is a few
cache lines in one place (a plain (kv heads, dim, slots) array spreads it over `dim` pages: writing
it and reading a block of slots then missed the TLB on every row).

Element types, as llama.cpp's -ctk/-ctv name them:
- f32, and f16 held as its uint16 bits (Numba has no float16);
- q8_0: blocks of QBLOCK values along the head dimension as int8 with a float16 scale
  d = max|x| / 127, quantized as llama.cpp's reference Q8_0 (34 bytes where float16 takes 64).
  A q8_0 row (one slot's values, or one row of a key tile) holds its int8 first, where float
  elements would be (dimension i at index i), and then its blocks' float16 scales as byte pairs:
  value rows (dim + 2 * blocks) bytes, key tiles dim + 2 * blocks rows, of which rows dim + 2b and
  dim + 2b + 1 hold block b's scales of the tile's KEY_TILE slots in slot order.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from .blocks import quantize_q8_0
from .intrinsics import QBLOCK, QBLOCK_BYTES, f16_bits, from_f32
from .ir import LANES

# Slots per key tile: one vector of scores (see cache_product).
KEY_TILE = LANES
ELEMENTS = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}


def new_cache(n_kv, key_dim, value_dim, slots, kv_type):
    """Zeroed keys and values for `slots` slots of kv_type (keys get whole tiles); q8_0 needs
    dims that are multiples of QBLOCK."""
    tiles = -(-slots // KEY_TILE)
    if kv_type == "q8_0":
        if key_dim % QBLOCK or value_dim % QBLOCK:
            raise ValueError(f"a q8_0 KV cache needs head sizes that are multiples of {QBLOCK}, "
                             f"not {key_dim} and {value_dim}")
        key_dim, value_dim = key_dim * QBLOCK_BYTES // QBLOCK, value_dim * QBLOCK_BYTES // QBLOCK
    dtype = ELEMENTS[kv_type]
    return np.zeros((n_kv, tiles, key_dim, KEY_TILE), dtype), np.zeros((n_kv, slots, value_dim), dtype)


def as_kernel_array(cache):
    """A cache array as the kernels take it: float16 as its uint16 bits, others as they are."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


def head_dims(keys, values):
    """(key dim, value dim) that the cache arrays hold."""
    return _held_dim(keys), _held_dim(values)


def _held_dim(cache):
    """The head dimension of a cache array (its axis 2: dims, or q8_0 blocks and their scales)."""
    width = cache.shape[2]
    return width * QBLOCK // QBLOCK_BYTES if cache.dtype == np.int8 else width


def cached_rows(keys, values, n):
    """Slots 0..n-1 of the cache as float32 (n, kv heads, dim) keys and values."""
    return key_columns(keys, n).transpose(2, 0, 1), value_rows(values, n).transpose(1, 0, 2)


def key_columns(keys, n):
    """The keys of slots 0..n-1 as float32 (kv heads, dim, n), from the tiles that hold them."""
    n_kv, dim = keys.shape[0], _held_dim(keys)
    tiles = keys[:, :-(-n // KEY_TILE)]
    if keys.dtype == np.int8:
        # (kv, tiles, 2 * blocks, KEY_TILE) bytes -> (kv, tiles, blocks, KEY_TILE) float16 scales
        scales = np.ascontiguousarray(tiles[:, :, dim:]).view(np.float16).reshape(n_kv, -1, dim // QBLOCK, KEY_TILE)
        tiles = tiles[:, :, :dim] * np.repeat(scales.astype(np.float32), QBLOCK, axis=2)
    tiles = tiles.astype(np.float32, copy=False)
    return tiles.transpose(0, 2, 1, 3).reshape(n_kv, dim, -1)[:, :, :n]


def value_rows(values, n):
    """The values of slots 0..n-1 as float32 (kv heads, n, dim)."""
    rows = values[:, :n]
    if values.dtype == np.int8:
        dim = _held_dim(values)
        scales = np.ascontiguousarray(rows[:, :, dim:]).view(np.float16).astype(np.float32)
        return rows[:, :, :dim] * np.repeat(scales, QBLOCK, axis=2)
    return rows.astype(np.float32)


def export_rows(keys, values, slots):
    """The slots' contents exactly as stored, as (kv heads, len(slots), width) copies of each: the
    layout of snapshots on every backend, where a q8_0 key row is laid out as a value row (int8,
    then its blocks' scales as byte pairs)."""
    tiles, at = _tiles_holding(slots)
    return _key_rows(keys[:, tiles])[:, at], values[:, slots]


def import_rows(keys, values, slots, key_rows, value_rows):
    """export_rows' arrays back into the slots."""
    tiles, at = _tiles_holding(slots)
    rows = _key_rows(keys[:, tiles])
    rows[:, at] = key_rows
    keys[:, tiles] = _key_tiles(rows, keys.shape[2])
    values[:, slots] = value_rows


def _tiles_holding(slots):
    """The key tiles that hold the slots, and where each slot's row is among those tiles' rows."""
    slots = np.asarray(slots, dtype=np.int64)
    tiles = np.unique(slots // KEY_TILE)
    return tiles, np.searchsorted(tiles, slots // KEY_TILE) * KEY_TILE + slots % KEY_TILE


def _scale_lanes():
    """Where slot j of a q8_0 key tile keeps its scales' bytes: row offset j // 8 within its
    block's two rows, bytes 2 (j % 8) and 2 (j % 8) + 1 (see the module docstring)."""
    j = np.arange(KEY_TILE)
    return j // 8, 2 * (j % 8)


def _key_rows(keys):
    """Key tiles (kv heads, tiles, width, KEY_TILE) as one row per slot (kv heads, slots, width)."""
    n_kv, tiles, width, _ = keys.shape
    rows = keys.transpose(0, 1, 3, 2).reshape(n_kv, tiles * KEY_TILE, width)
    if keys.dtype == np.int8:
        dim = _held_dim(keys)
        half, byte = _scale_lanes()
        blocks = (width - dim) // 2
        scales = keys[:, :, dim:].reshape(n_kv, tiles, blocks, 2, KEY_TILE)  # (.., blocks, row of the pair, byte)
        pairs = np.stack([scales[:, :, :, half, byte], scales[:, :, :, half, byte + 1]], axis=-1)
        rows[:, :, dim:] = pairs.transpose(0, 1, 3, 2, 4).reshape(n_kv, tiles * KEY_TILE, width - dim)
    return rows


def _key_tiles(rows, width):
    """_key_rows inverted: (kv heads, slots, width) rows, slots a multiple of KEY_TILE, as tiles."""
    n_kv, slots, _ = rows.shape
    n_tiles = slots // KEY_TILE
    tiles = np.ascontiguousarray(rows.reshape(n_kv, n_tiles, KEY_TILE, width).transpose(0, 1, 3, 2))
    if rows.dtype == np.int8:
        dim = width * QBLOCK // QBLOCK_BYTES
        half, byte = _scale_lanes()
        blocks = (width - dim) // 2
        # (kv heads, tiles, blocks, slot, byte of the pair)
        pairs = rows[:, :, dim:].reshape(n_kv, n_tiles, KEY_TILE, blocks, 2).transpose(0, 1, 3, 2, 4)
        scales = np.zeros((n_kv, n_tiles, blocks, 2, KEY_TILE), np.int8)
        scales[:, :, :, half, byte] = pairs[..., 0]
        scales[:, :, :, half, byte + 1] = pairs[..., 1]
        tiles[:, :, dim:] = scales.reshape(n_kv, n_tiles, width - dim, KEY_TILE)
    return tiles


@njit(cache=True)
def store_kv(keys, values, slots, k, v):
    """Write token t's k[t] (kv heads, dim) into slot slots[t] of the keys and its v[t] into the
    values (kernel arrays: see as_kernel_array)."""
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(keys.shape[0]):
            _store_key(keys[h, s // KEY_TILE], s % KEY_TILE, k[t, h])
            _store_row(values[h, s], v[t, h])


def _store_key(tile, j, x):
    """Key x into column j of a key tile (dim rows, KEY_TILE)."""


def _store_row(row, x):
    """Value x into a value row."""


@overload(_store_key)
def _store_key_typed(tile, j, x):
    if tile.dtype == types.int8:
        def store_q8_0(tile, j, x):
            # block b's scale: bytes 2 (j % 8), + 1 of row dim + 2 b + j // 8 (the module's docstring)
            dim, lane = x.shape[0], 2 * (j % 8)
            _store_q8_0(x, tile[:dim, j], tile[dim + j // 8::2, lane:lane + 2])
        return store_q8_0
    return lambda tile, j, x: _store_row(tile[:, j], x)  # (float elements: a key's column as a value row)


@overload(_store_row)
def _store_row_typed(row, x):
    if row.dtype == types.int8:
        def store_q8_0(row, x):
            dim = x.shape[0]
            _store_q8_0(x, row, row[dim:].reshape((dim // QBLOCK, 2)))
        return store_q8_0

    def store_float(row, x):
        for i in range(x.shape[0]):
            row[i] = from_f32(x[i], row)
    return store_float


@njit(cache=True, inline="always")
def _store_q8_0(x, ints, scales):
    """x as q8_0 blocks: block b's int8 into ints[b * QBLOCK:], its float16 scale's bits into
    scales[b, 0:2] (little-endian)."""
    for b in range(x.shape[0] // QBLOCK):
        bits = f16_bits(quantize_q8_0(x[b * QBLOCK:(b + 1) * QBLOCK], ints[b * QBLOCK:(b + 1) * QBLOCK]))
        scales[b, 0], scales[b, 1] = np.int8(np.uint8(bits & 0xFF)), np.int8(np.uint8(bits >> 8))
