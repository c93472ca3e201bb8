"""llama.cpp's IQ2_XXS, IQ2_XS and IQ2_S quantizers (ggml-quants.c), reimplemented with Numba so
that our bytes equal llama.cpp's.

Each group of 8 weights becomes an entry of the type's grid (256, 512 or 1024 entries of 8
magnitudes, each one of three levels) and 8 signs; a scale per 32 (IQ2_XXS) or 16 weights, itself
a 4-bit multiple of the super-block's half-precision scale. The search for a group's entry rounds
the weights to levels at a trial scale and, when that point is not on the grid, picks among the
grid points nearest to it: the neighbour lists built once per grid below.

Byte equality needs llama.cpp's float32 arithmetic step by step, as in convert/quants.py: float32
constants, integers converted where C converts them, no fastmath, its nearest_int (the
+12582912 trick, exact also outside the range where it rounds) and its tie-breaking (first of
equal candidates, in its order).
"""
from __future__ import annotations

from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from gguf_io.quant_types import grid

from .block_math import F32, FLT_MAX, GROUP_MAX_EPS, make_qp_quants, nearest_int, put_f16, split_signs

QK_K = 256
GROUP_MAX_EPS_IQ2_S = F32(1e-8)
K_MAX_Q = 3                           # levels 0, 1, 2: magnitudes 1, 3, 5 times the scale (2 l + 1)
MAP_SIZE = 0xAAAA + 1                 # indices of 8 two-bit fields, each at most 2
IQ2_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S)
# how many of the smallest distinct distances a point's neighbour list spans (iq2xs_init_impl,
# which also builds IQ1_S's 2048-entry grid, shared by IQ1_M)
_NEIGHBOUR_DISTANCES = {T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 1, T.IQ1_S: 3}
# gguf's grid values per level: IQ2's magnitudes, IQ1's -1, 0, 1
_LEVEL_VALUES = {T.IQ1_S: (-1, 0, 1)}
_IQ2_LEVEL_VALUES = (8, 25, 43)
_IQ2_VALUES = np.array([1, 3, 5], F32)  # the levels' magnitudes in the quantizing space, 2 l + 1


# ---- the grid's neighbour lists --------------------------------------------------------------

@njit(cache=True)
def _neighbours(levels, distances):
    """kmap (MAP_SIZE,) int32 and the neighbour lists (uint16) of a grid with levels (entries, 8)
    in 0..2. kmap[u], for the point u (level l of weight i in bits 2i), is the point's grid entry
    when it is on the grid, else -1 - o, where lists[o] counts the entries that follow it: those at
    the `distances` smallest squared distances from u, by distance, then by entry. Points with a
    field of 3 are never looked up (levels are clamped to 2) and get no list."""
    n = levels.shape[0]
    kmap = np.full(MAP_SIZE, -1, np.int32)
    for j in range(n):
        u = 0
        for i in range(8):
            u |= np.int32(levels[j, i]) << (2 * i)
        kmap[u] = j
    lists = np.empty(1 << 16, np.uint16)
    used = 0
    d2 = np.empty(n, np.int32)
    for u in range(MAP_SIZE):
        if kmap[u] >= 0:
            continue
        valid = True
        for i in range(8):
            if (u >> (2 * i)) & 3 == 3:
                valid = False
        if not valid:
            continue
        for j in range(n):
            s = 0
            for i in range(8):
                diff = 2 * (np.int32(levels[j, i]) - ((u >> (2 * i)) & 3))
                s += diff * diff
            d2[j] = s
        if used + 1 + n > lists.shape[0]:
            grown = np.empty(2 * lists.shape[0] + n, np.uint16)
            grown[:used] = lists[:used]
            lists = grown
        kmap[u] = -1 - used
        start = used
        used += 1
        last = -1
        for _ in range(distances):
            nearest = 1 << 30
            for j in range(n):
                if last < d2[j] < nearest:
                    nearest = d2[j]
            if nearest == 1 << 30:
                break
            for j in range(n):
                if d2[j] == nearest:
                    lists[used] = j
                    used += 1
            last = nearest
        lists[start] = used - start - 1
    return kmap, lists[:used].copy()


@cache
def tables(qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels (entries, 8) int8 in 0..2, kmap, neighbour lists) of an IQ2 or IQ1 type's grid,
    built once (IQ1_M's are IQ1_S's)."""
    if qtype == T.IQ1_M:
        return tables(T.IQ1_S)
    values = grid(qtype)
    levels = np.full(values.shape, -1, np.int8)
    for level, value in enumerate(_LEVEL_VALUES.get(qtype, _IQ2_LEVEL_VALUES)):
        levels[values == value] = level
    assert (levels >= 0).all()
    kmap, lists = _neighbours(levels, _NEIGHBOUR_DISTANCES[qtype])
    return levels, kmap, lists


# ---- shared steps ----------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _point(L, at):
    u = 0
    for i in range(8):
        u |= np.int32(L[at + i]) << (2 * i)
    return u


@njit(cache=True)
def _best_neighbour(lists, start, levels, values, xval, w, at, scale, L):
    """ggml's iq2_find_best_neighbour (and iq1_find_best_neighbour2): of the listed entries, the
    first of least squared error weighted by w at `scale` for xval[at:at+8], a level l standing
    for values[l]; its levels into L[at:at+8]."""
    best_d2 = FLT_MAX
    best = -1
    for j in range(1, np.int32(lists[start]) + 1):
        g = np.int32(lists[start + j])
        d2 = F32(0.0)
        for i in range(8):
            diff = scale * values[levels[g, i]] - xval[at + i]
            d2 += w[at + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            best = g
    if best < 0:
        raise ValueError("IQ quantization: no finite neighbour (weights out of float32's range?)")
    for i in range(8):
        L[at + i] = levels[best, i]
    return best


@njit(cache=True)
def _round_group(id_, xval, at, L):
    """The levels of xval[at:at+8] at inverse scale id_, clamped to 0..2, into L; their point."""
    for i in range(8):
        l = nearest_int(F32(0.5) * (id_ * xval[at + i] - F32(1.0)))
        L[at + i] = max(0, min(K_MAX_Q - 1, l))
    return _point(L, at)


@njit(cache=True)
def _grid_group(levels, kmap, lists, id_, scale, xval, waux, at, L):
    """Levels of xval[at:at+8] rounded at inverse scale id_, moved to the best neighbouring grid
    entry (at `scale`) when not on the grid. Returns (entry, was on the grid)."""
    u = _round_group(id_, xval, at, L)
    g = kmap[u]
    if g >= 0:
        return g, True
    return _best_neighbour(lists, -1 - g, levels, _IQ2_VALUES, xval, waux, at, scale, L), False


@njit(cache=True, inline="always")
def _fit(weight, xval, L, n):
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for i in range(n):
        w = weight[i]
        q = F32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True, inline="always")
def _sigma2(xbl, factor):
    sumx2 = F32(0.0)
    for i in range(QK_K):
        sumx2 += xbl[i] * xbl[i]
    return factor * sumx2 / F32(QK_K)


@njit(cache=True, inline="always")
def _group_max(xval):
    m = xval[0]
    for i in range(1, xval.shape[0]):
        m = m if m > xval[i] else xval[i]
    return m


@njit(cache=True, inline="always")
def _scale_code(id_, scale):
    return max(0, min(15, nearest_int(F32(0.5) * (id_ * scale - F32(1.0)))))


@njit(cache=True)
def _prepare(xb, qw, use_qw, sigma2, weight, waux, xval, parity, eps):
    """A group's weights (importance times sqrt(sigma2 + x^2), or sigma2 / 4 + x^2 without an
    importance matrix), their square roots, |x| and the signs; whether the group is all zero."""
    n = xb.shape[0]
    if use_qw:
        for i in range(n):
            weight[i] = qw[i] * np.sqrt(sigma2 + xb[i] * xb[i])
    else:
        for i in range(n):
            weight[i] = F32(0.25) * sigma2 + xb[i] * xb[i]
    for i in range(n):
        waux[i] = np.sqrt(weight[i])
    signs = np.zeros(n // 8, np.uint8)
    split_signs(xb, weight, xval, signs, parity)
    return signs, _group_max(xval) < eps


@njit(cache=True, inline="always")
def _positive(scale, signs, mask):
    """A negative fitted scale made positive by flipping the signs (which llama.cpp guards against
    though it should not happen)."""
    if scale < 0:
        for k in range(signs.shape[0]):
            signs[k] = ~signs[k] & mask
        return -scale
    return scale


@njit(cache=True)
def _nibble_scales(out, at, scales, id_):
    for ib in range(scales.shape[0]):
        out[at + ib // 2] |= np.uint8(_scale_code(id_, scales[ib]) << (4 * (ib % 2)))


# ---- IQ2_XXS: d, then per 32 weights 4 grid bytes and a word of 4 x 7 signs and a 4-bit scale ----

@njit(cache=True)
def _search32(xval, weight, waux, L, Laux, levels, kmap, lists):
    """The scale and levels (in L) of 32 weights: make_qp_quants' scale, trial scales around it,
    then all four groups rounded again at the best fitted scale. Zero when all weigh nothing."""
    n = 32
    Lqp = np.zeros(n, np.uint8)
    scale = make_qp_quants(xval, K_MAX_Q + 1, Lqp, weight)
    for i in range(n):
        L[i] = np.int8(np.int32(Lqp[i]) - 256 if Lqp[i] > 127 else Lqp[i])
    eff_max = scale * F32(K_MAX_Q)
    if eff_max <= 0:
        L[:] = 0
        return F32(0.0), False
    best = F32(0.0)
    for step in range(-6, 7):
        id_ = (F32(2 * K_MAX_Q - 1) + F32(step) * F32(0.1)) / eff_max
        this_scale = F32(1.0) / id_
        for k in range(n // 8):
            _grid_group(levels, kmap, lists, id_, this_scale, xval, waux, 8 * k, Laux)
        sumqx, sumq2 = _fit(weight, xval, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
    if scale > 0:
        id_ = F32(1.0) / scale
        for k in range(n // 8):
            g, _ = _grid_group(levels, kmap, lists, id_, scale, xval, waux, 8 * k, L)
            for i in range(8):
                L[8 * k + i] = levels[g, i]
        sumqx, sumq2 = _fit(weight, xval, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale, True


@njit(cache=True)
def _iq2_xxs_block(xbl, qw, use_qw, levels, kmap, lists, out):
    n = 32
    weight, waux, xval = np.empty(n, F32), np.empty(n, F32), np.empty(n, F32)
    L, Laux = np.zeros(n, np.int8), np.zeros(n, np.int8)
    scales = np.zeros(QK_K // n, F32)
    q2 = np.zeros(2 * (QK_K // n), np.uint32)
    out[:] = 0
    max_scale = F32(0.0)
    sigma2 = _sigma2(xbl, F32(1.0))
    for ib in range(QK_K // n):
        signs, zero = _prepare(xbl[n * ib:n * (ib + 1)], qw[n * ib:n * (ib + 1)], use_qw, sigma2,
                               weight, waux, xval, True, GROUP_MAX_EPS)
        if zero:
            continue
        scale, packed = _search32(xval, weight, waux, L, Laux, levels, kmap, lists)
        if not packed:
            continue
        scale = _positive(scale, signs, 127)
        for k in range(n // 8):
            q2[2 * ib] |= np.uint32(kmap[_point(L, 8 * k)]) << (8 * k)
            q2[2 * ib + 1] |= np.uint32(signs[k]) << (7 * k)
        scales[ib] = scale
        max_scale = max_scale if max_scale > scale else scale
    if max_scale == 0:
        return
    d = max_scale / F32(31.0)
    put_f16(out, 0, d)
    id_ = F32(1.0) / d
    for ib in range(QK_K // n):
        q2[2 * ib + 1] |= np.uint32(_scale_code(id_, scales[ib])) << 28
    out[2:2 + QK_K // 4] = q2.view(np.uint8)


# ---- IQ2_XS and IQ2_S: per 16 weights; XS keeps 7 sign bits and 9-bit entries, S 8 and 10 ------

@njit(cache=True)
def _search16(xval, weight, waux, L, Laux, levels, kmap, lists):
    """The scale and levels (in L) of 16 weights: trial scales around max/5, then the groups that
    were off the grid at the best one rounded again at its fitted scale."""
    n = 16
    L[:] = 0
    fmax = _group_max(xval)
    best = F32(0.0)
    scale = fmax / F32(2 * K_MAX_Q - 1)
    on_grid0 = True
    on_grid1 = True
    for step in range(-9, 10):
        id_ = (F32(2 * K_MAX_Q - 1) + F32(step) * F32(0.1)) / fmax
        this_scale = F32(1.0) / id_
        _, aux0 = _grid_group(levels, kmap, lists, id_, this_scale, xval, waux, 0, Laux)
        _, aux1 = _grid_group(levels, kmap, lists, id_, this_scale, xval, waux, 8, Laux)
        sumqx, sumq2 = _fit(weight, xval, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            on_grid0 = aux0
            on_grid1 = aux1
    if (not on_grid0 or not on_grid1) and scale > 0:
        id_ = F32(1.0) / scale
        if not on_grid0:
            _grid_group(levels, kmap, lists, id_, scale, xval, waux, 0, L)
        if not on_grid1:
            _grid_group(levels, kmap, lists, id_, scale, xval, waux, 8, L)
        sumqx, sumq2 = _fit(weight, xval, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit(cache=True)
def _iq2_16_block(xbl, qw, use_qw, is_s, levels, kmap, lists, out):
    """IQ2_XS: d, 32 words of a 9-bit entry and 7 signs, 8 bytes of 4-bit scales.
    IQ2_S: d, 32 low bytes of the entries, 32 sign bytes, 8 bytes of the entries' top 2 bits, 8
    bytes of 4-bit scales; d stored slightly smaller."""
    n = 16
    weight, waux, xval = np.empty(n, F32), np.empty(n, F32), np.empty(n, F32)
    L, Laux = np.zeros(n, np.int8), np.zeros(n, np.int8)
    scales = np.zeros(QK_K // n, F32)
    qh = 2 + QK_K // 4
    out[:] = 0
    max_scale = F32(0.0)
    sigma2 = _sigma2(xbl, F32(2.0) if is_s else F32(1.0))
    for ib in range(QK_K // n):
        signs, zero = _prepare(xbl[n * ib:n * (ib + 1)], qw[n * ib:n * (ib + 1)], use_qw, sigma2,
                               weight, waux, xval, not is_s, GROUP_MAX_EPS_IQ2_S if is_s else GROUP_MAX_EPS)
        if zero:
            continue
        scale = _positive(_search16(xval, weight, waux, L, Laux, levels, kmap, lists), signs, 255 if is_s else 127)
        for k in range(2):
            g = kmap[_point(L, 8 * k)]
            i8 = 2 * ib + k
            if is_s:
                out[2 + i8] = np.uint8(g & 255)
                out[qh + i8 // 4] |= np.uint8((g >> 8) << (2 * (i8 % 4)))
                out[2 + QK_K // 8 + i8] = signs[k]
            else:
                v = g | (np.int32(signs[k]) << 9)
                out[2 + 2 * i8] = np.uint8(v & 255)
                out[3 + 2 * i8] = np.uint8(v >> 8)
        scales[ib] = scale
        max_scale = max_scale if max_scale > scale else scale
    if max_scale == 0:
        if not is_s:  # (IQ2_XS clears its entries and signs; IQ2_S keeps them)
            out[:] = 0
        return
    d = max_scale / F32(31.0)
    put_f16(out, 0, d * F32(0.9875) if is_s else d)
    _nibble_scales(out, qh + QK_K // 32 if is_s else qh, scales, F32(1.0) / d)


# ---- rows ----------------------------------------------------------------------------------

@njit(cache=True, parallel=True)
def _iq2_rows(kind, x, qw, use_qw, levels, kmap, lists, out):
    """kind 0, 1, 2: IQ2_XXS, IQ2_XS, IQ2_S. Without use_qw, qw is a (k,) array never read."""
    nb = x.shape[1] // QK_K
    bb = out.shape[1] // nb
    for r in prange(x.shape[0]):
        for b in range(nb):
            xbl = x[r, b * QK_K:(b + 1) * QK_K]
            qwbl = qw[b * QK_K:(b + 1) * QK_K]
            ob = out[r, b * bb:(b + 1) * bb]
            if kind == 0:
                _iq2_xxs_block(xbl, qwbl, use_qw, levels, kmap, lists, ob)
            else:
                _iq2_16_block(xbl, qwbl, use_qw, kind == 2, levels, kmap, lists, ob)


def quantize_iq2(x: np.ndarray, qtype: T, importance: np.ndarray | None) -> np.ndarray:
    """Rows of float32 x (rows, k), k a multiple of 256, -> raw GGUF rows (rows, bytes) of IQ2_XXS,
    IQ2_XS or IQ2_S, weighted by the importance matrix's column values (k,). IQ2_XXS and IQ2_XS
    need one (llama.cpp asserts on a missing one); IQ2_S without one weights each weight by
    sigma^2 / 4 + x^2 (sigma^2 twice the mean square of its 256)."""
    if qtype not in IQ2_TYPES:
        raise ValueError(f"quantize_iq2 quantizes IQ2_XXS, IQ2_XS and IQ2_S, not {qtype.name}")
    x, qw, out = checked_rows(x, qtype, importance, required=qtype != T.IQ2_S)
    levels, kmap, lists = tables(qtype)
    _iq2_rows(IQ2_TYPES.index(qtype), x, qw, importance is not None, levels, kmap, lists, out)
    return out


def checked_rows(x: np.ndarray, qtype: T, importance: np.ndarray | None,
                 required: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x as contiguous float32 rows (rows, k), the importance vector (k,) float32 (zeros, never
    read, where None), the zeroed output rows (rows, bytes) uint8) for the grid quantizers, with
    ValueErrors for a row length not a multiple of 256, a missing importance matrix where
    `required`, an importance vector of another length and non-finite values."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1])
    k = x.shape[1]
    if k % QK_K:
        raise ValueError(f"row length {k} is not a multiple of the {qtype.name} block size {QK_K}")
    if importance is None:
        if required:
            raise ValueError(f"{qtype.name} needs an importance matrix (make one with `ggrun imatrix`)")
        qw = np.zeros(k, np.float32)
    else:
        qw = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
        if qw.shape[0] != k:
            raise ValueError(f"importance has {qw.shape[0]} values for rows of {k}")
    if not np.isfinite(x).all():
        raise ValueError(f"cannot quantize non-finite values to {qtype.name}")
    return x, qw, np.zeros((x.shape[0], k // QK_K * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
