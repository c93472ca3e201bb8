"""IQ3_XXS and IQ3_S quantizers: llama.cpp's (ggml-quants.c, quantize_iq3_xxs and quantize_iq3_s),
reimplemented with Numba so that our bytes equal llama.cpp's, with or without an importance vector.

Each group of four weights takes the magnitudes of one grid entry (values 2l+1, l < 8, in llama.cpp's
quantizing space); the search tries a range of scales, rounds each group to the eight levels, and
where the rounded point is not in the grid picks the best of its nearest grid entries (the
neighbour lists, made once from the grid as llama.cpp's iq3xs_init_impl makes them).

Byte equality needs llama.cpp's float32 arithmetic step by step: every constant is float32, integer
operands are converted where C converts them, sums run in C's order, nothing runs with fastmath,
and nearest_int is llama.cpp's magic-number rounding (bits of x + 1.5 * 2^23).
"""
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from gguf_io.quant_types import grid
from kernels_cpu.intrinsics import f16_bits

from .block_math import F32, FLT_MAX, nearest_int, split_signs

QK_K = 256
# how many distinct distances each off-grid point's neighbour list spans (llama.cpp's nwant)
_NEIGHBOUR_DISTANCES = {T.IQ3_XXS: 2, T.IQ3_S: 3}


# ---- the grid's tables ---------------------------------------------------------------------

@cache
def tables(qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qgrid, kmap, neighbours) for IQ3_XXS (256 entries) or IQ3_S (512), as llama.cpp's
    iq3xs_init_impl makes them:
    - qgrid (entries, 4) int8: each entry's levels as 2l+1 (l < 8, the rank of its stored value);
    - kmap (4096,) int32: for the point of levels l0..l3 (index l0 | l1 << 3 | l2 << 6 | l3 << 9),
      its grid entry, or -(offset + 1) where it is off the grid;
    - neighbours int32: at offset, a count n, then n grid entries: those at the nearest distances
      (two distinct squared distances for IQ3_XXS, three for IQ3_S), by distance, then entry."""
    values = grid(qtype).astype(np.int32)
    levels = np.unique(values)
    assert len(levels) == 8
    ql = np.searchsorted(levels, values)  # (entries, 4) levels 0..7
    qgrid = (2 * ql + 1).astype(np.int8)
    kmap = np.full(4096, -1, np.int32)
    kmap[(ql << np.array([0, 3, 6, 9])).sum(axis=1)] = np.arange(len(ql), dtype=np.int32)

    points = (np.arange(4096)[:, None] >> np.array([0, 3, 6, 9])) & 7
    d2 = (((2 * points + 1)[:, None, :] - qgrid[None, :, :].astype(np.int32)) ** 2).sum(axis=2)  # (4096, entries)
    off = np.flatnonzero(kmap < 0)
    order = np.argsort(d2[off] * len(qgrid) + np.arange(len(qgrid)), axis=1)  # by distance, then entry
    ordered = np.take_along_axis(d2[off], order, axis=1)
    rank = np.concatenate([np.zeros((len(off), 1), int), np.cumsum(np.diff(ordered, axis=1) > 0, axis=1)], axis=1)
    near = rank < _NEIGHBOUR_DISTANCES[qtype]  # (a prefix of each row)
    counts = near.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    kmap[off] = -(starts + 1)
    neighbours = np.zeros(len(off) + counts.sum(), np.int32)
    neighbours[starts] = counts
    rows, cols = np.nonzero(near)
    neighbours[starts[rows] + 1 + cols] = order[rows, cols]
    for a in (qgrid, kmap, neighbours):
        a.flags.writeable = False
    return qgrid, kmap, neighbours


# ---- the search of one group of 32 ---------------------------------------------------------

@njit(cache=True)
def _best_neighbour(neighbours, at, qgrid, xval, waux, scale, L, k):
    """The entry among the neighbour list at `at` nearest to xval[4k:4k+4] / scale (weighted by
    waux); its levels into L[4k:4k+4]. (iq3_find_best_neighbour)"""
    best_d2 = FLT_MAX
    index = -1
    for j in range(1, neighbours[at] + 1):
        e = neighbours[at + j]
        d2 = F32(0.0)
        for i in range(4):
            diff = scale * F32(qgrid[e, i]) - xval[4 * k + i]
            d2 += waux[4 * k + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            index = e
    for i in range(4):
        L[4 * k + i] = (qgrid[index, i] - 1) // 2
    return index


@njit(cache=True, inline="always")
def _round_group(xval, id, k, L):
    """Levels of xval[4k:4k+4] * id into L; the point's index."""
    u = 0
    for i in range(4):
        l = nearest_int(F32(0.5) * (id * xval[4 * k + i] - F32(1.0)))
        l = max(0, min(7, l))
        L[4 * k + i] = l
        u |= l << (3 * i)
    return u


@njit(cache=True, inline="always")
def _sums(weight, xval, L):
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for i in range(32):
        w = weight[i]
        q = F32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True)
def _search(xval, weight, waux, vmax, steps, on_grid_first, refit_all, qgrid, kmap, neighbours,
            L, Laux, on_grid, on_grid_aux):
    """The scale of 32 magnitudes xval (max vmax) and their levels L, each group of four on the
    grid: the best of the scales (15 + 0.2 s) / vmax for |s| <= steps, then one refit at that scale
    of the groups (all, or those that were off the grid)."""
    L[:] = 0
    best = F32(0.0)
    scale = vmax / F32(15.0)
    on_grid[:] = on_grid_first
    for s in range(-steps, steps + 1):
        id = (F32(15.0) + F32(s) * F32(0.2)) / vmax
        this_scale = F32(1.0) / id
        for k in range(8):
            u = _round_group(xval, id, k, Laux)
            on_grid_aux[k] = kmap[u] >= 0
            if kmap[u] < 0:
                _best_neighbour(neighbours, -kmap[u] - 1, qgrid, xval, waux, this_scale, Laux, k)
        sumqx, sumq2 = _sums(weight, xval, Laux)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            on_grid[:] = on_grid_aux
    if not on_grid.all() and scale > 0:
        id = F32(1.0) / scale
        for k in range(8):
            if on_grid[k] and not refit_all:
                continue
            u = _round_group(xval, id, k, L)
            e = kmap[u]
            if e < 0:
                e = _best_neighbour(neighbours, -e - 1, qgrid, xval, waux, scale, L, k)
            for i in range(4):
                L[4 * k + i] = (qgrid[e, i] - 1) // 2
        sumqx, sumq2 = _sums(weight, xval, L)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit(cache=True)
def _group(xb, qw, sigma2, xxs, qgrid, kmap, neighbours, work):
    """One group of 32 weights xb (importance qw, or none): its sign bytes (four, of eight weights
    each; IQ3_XXS's keep seven bits, their count made even by flipping back the weight that matters
    least) and levels into work; its scale, or -1 where llama.cpp takes it as zero."""
    weight, waux, xval, _, L, Laux, on_grid, on_grid_aux, signs, _ = work
    for i in range(32):
        if qw.shape[0]:
            weight[i] = qw[i] * np.sqrt(sigma2 + xb[i] * xb[i])
        else:
            weight[i] = xb[i] * xb[i]
        waux[i] = np.sqrt(weight[i])
    split_signs(xb, weight, xval, signs, xxs)
    vmax = xval[0]
    for i in range(1, 32):
        if not vmax > xval[i]:
            vmax = xval[i]
    if (vmax < F32(1e-8)) if xxs else not vmax:
        return F32(-1.0)
    if xxs:
        scale = _search(xval, weight, waux, vmax, 15, True, False, qgrid, kmap, neighbours, L, Laux, on_grid, on_grid_aux)
    else:
        scale = _search(xval, weight, waux, vmax, 9, False, True, qgrid, kmap, neighbours, L, Laux, on_grid, on_grid_aux)
    if scale < 0:  # (llama.cpp's guard: flip the signs with the scale)
        scale = -scale
        for k in range(4):
            signs[k] = ~signs[k] & (127 if xxs else 255)
    return scale


@njit(cache=True, inline="always")
def _sigma2(x):
    sumx2 = F32(0.0)
    for v in x:
        sumx2 += v * v
    return F32(2.0) * sumx2 / F32(QK_K)


@njit(cache=True, inline="always")
def _group_entry(kmap, L, k):
    u = 0
    for i in range(4):
        u |= np.int32(L[4 * k + i]) << (3 * i)
    return kmap[u]


@njit(cache=True, inline="always")
def _inverse_step(out, max_scale, fudge):
    """The block's scale step, max_scale / 31, stored as half (times fudge); its inverse."""
    d = max_scale / F32(31.0)
    h = f16_bits(F32(d * fudge))
    out[0] = np.uint8(h & 0xFF)
    out[1] = np.uint8(h >> 8)
    return F32(1.0) / d


@njit(cache=True, inline="always")
def _scale_code(id, scale):
    return max(0, min(15, nearest_int(F32(0.5) * (id * scale - F32(1.0)))))


# ---- the blocks ----------------------------------------------------------------------------

@njit(cache=True)
def _iq3_xxs(x, qw, out, qgrid, kmap, neighbours, work):  # d qs[64] scales_and_signs[8 x u32]
    L, signs, scales, sas = work[4], work[8], work[3], work[9]
    out[:] = 0
    sigma2 = _sigma2(x)
    max_scale = F32(0.0)
    for ib in range(8):
        scale = _group(x[32 * ib:32 * ib + 32], qw[32 * ib:32 * ib + 32] if qw.shape[0] else qw, sigma2, True,
                       qgrid, kmap, neighbours, work)
        sas[ib] = 0
        scales[ib] = 0
        if scale < 0:
            continue
        for k in range(8):
            out[2 + 8 * ib + k] = np.uint8(_group_entry(kmap, L, k))
        sas[ib] = signs[0] | signs[1] << 7 | signs[2] << 14 | signs[3] << 21
        scales[ib] = scale
        if not max_scale > scale:
            max_scale = scale
    if not max_scale:  # llama.cpp clears the block
        out[:] = 0
        return
    id = _inverse_step(out, max_scale, F32(1.0125))
    for ib in range(8):
        v = sas[ib] | np.int64(_scale_code(id, scales[ib])) << 28
        for j in range(4):
            out[66 + 4 * ib + j] = np.uint8((v >> (8 * j)) & 0xFF)


@njit(cache=True)
def _iq3_s(x, qw, out, qgrid, kmap, neighbours, work):  # d qs[64] qh[8] signs[32] scales[4]
    L, signs, scales = work[4], work[8], work[3]
    out[:] = 0
    sigma2 = _sigma2(x)
    max_scale = F32(0.0)
    qs = 2  # llama.cpp moves its qs and signs pointers past a group only when the group is not all zero
    sg = 74
    for ib in range(8):
        scale = _group(x[32 * ib:32 * ib + 32], qw[32 * ib:32 * ib + 32] if qw.shape[0] else qw, sigma2, False,
                       qgrid, kmap, neighbours, work)
        scales[ib] = 0
        if scale < 0:
            continue
        for k in range(8):
            e = _group_entry(kmap, L, k)
            out[qs + k] = np.uint8(e & 255)
            out[66 + ib] |= np.uint8((e >> 8) << k)
        qs += 8
        for k in range(4):
            out[sg + k] = np.uint8(signs[k])
        sg += 4
        scales[ib] = scale
        if not max_scale > scale:
            max_scale = scale
    if not max_scale:
        return
    id = _inverse_step(out, max_scale, F32(1.033))
    for ib in range(0, 8, 2):
        out[106 + ib // 2] = np.uint8(_scale_code(id, scales[ib]) | _scale_code(id, scales[ib + 1]) << 4)


@njit(cache=True, parallel=True)
def _rows(x, qw, out, xxs, qgrid, kmap, neighbours):
    block_bytes = out.shape[1] // (x.shape[1] // QK_K)
    for r in prange(x.shape[0]):
        # weight, waux, xval, scales, L, Laux, on_grid, on_grid_aux, signs, IQ3_XXS's scales_and_signs
        work = (np.empty(32, F32), np.empty(32, F32), np.empty(32, F32), np.empty(8, F32),
                np.empty(32, np.int32), np.empty(32, np.int32), np.empty(8, np.bool_), np.empty(8, np.bool_),
                np.empty(4, np.int64), np.empty(8, np.int64))
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            qwb = qw[b * QK_K:(b + 1) * QK_K] if qw.shape[0] else qw
            ob = out[r, b * block_bytes:(b + 1) * block_bytes]
            if xxs:
                _iq3_xxs(xb, qwb, ob, qgrid, kmap, neighbours, work)
            else:
                _iq3_s(xb, qwb, ob, qgrid, kmap, neighbours, work)


def quantize_iq3(x: np.ndarray, qtype: T, importance: np.ndarray | None = None) -> np.ndarray:
    """Rows of float32 x (N, K), K a multiple of 256 -> raw GGUF rows (N, bytes per row) of IQ3_XXS
    or IQ3_S; importance (K,): the importance matrix's vector for this matrix's columns, or None."""
    qtype = T(qtype)
    if qtype not in (T.IQ3_XXS, T.IQ3_S):
        raise ValueError(f"quantize_iq3 does not make {qtype.name}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if x.shape[1] % block:
        raise ValueError(f"row length {x.shape[1]} is not a multiple of the {qtype.name} block size {block}")
    if importance is None:
        qw = np.empty(0, np.float32)
    else:
        qw = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
        if qw.shape[0] != x.shape[1]:
            raise ValueError(f"importance has {qw.shape[0]} values for rows of {x.shape[1]}")
    out = np.zeros((x.shape[0], x.shape[1] // block * block_bytes), dtype=np.uint8)
    _rows(x, qw, out, qtype == T.IQ3_XXS, *tables(qtype))
    return out
