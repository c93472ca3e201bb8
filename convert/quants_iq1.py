"""llama.cpp's IQ1_S and IQ1_M quantizers (ggml-quants.c), reimplemented with Numba so that our
bytes equal llama.cpp's.

Each group of 8 weights becomes an entry of IQ1_S's 2048-entry grid (8 levels -1, 0, 1), shifted
by plus or minus a small delta: IQ1_S per 32 weights (one shift and a 3-bit scale), IQ1_M per 16
(a shift per group of 8 and a 3-bit scale, the super-block's half-precision scale spread over
the top bits of the scales).

The search is exact before the grid: the weights sorted, every pair of boundaries between levels
-1, 0 and 1 tried with prefix sums, for each choice of shifts. Where the levels so found are not
a grid entry, the best of the entries nearest to them (the neighbour lists of
convert/quants_iq2.tables, three distances deep) replaces them and the scale is fitted again.

Byte equality needs llama.cpp's float32 arithmetic step by step, as in convert/quants_iq2.py, and
its order among equal weights: C's qsort, which glibc runs as a stable merge sort.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from kernels_cpu.intrinsics import f16_bits

from .block_math import F32, FLT_MAX, nearest_int, put_f16
from .quants_iq2 import QK_K, _best_neighbour, checked_rows, _sigma2, tables

IQ1_TYPES = (T.IQ1_S, T.IQ1_M)
DELTA = F32(0.125)                    # IQ1S_DELTA and IQ1M_DELTA
GROUP_MAX_EPS_IQ1_S = F32(1e-12)
GROUP_MAX_EPS_IQ1_M = F32(1e-7)


# the levels' values in the quantizing space, level - 1 shifted by plus DELTA (row 0) or minus
# (row 1): llama.cpp's x_p and x_m
SHIFTED = np.array([np.arange(3, dtype=F32) - F32(1) + DELTA, np.arange(3, dtype=F32) - F32(1) - DELTA])


@njit(cache=True, inline="always")
def _value(minus, level):
    return SHIFTED[1 if minus else 0, level]


@njit(cache=True)
def _sort_order(xb, idx):
    """Indices of xb in ascending order, equal values in index order (a stable sort, as glibc's
    qsort is for arrays this small)."""
    n = xb.shape[0]
    for j in range(n):
        i = j
        v = xb[j]
        m = j
        while m > 0 and xb[idx[m - 1]] > v:
            idx[m] = idx[m - 1]
            m -= 1
        idx[m] = i


@njit(cache=True)
def _place(xb, weight, idx, i1, i2, scale, minus, levels, kmap, lists, L, index):
    """Levels 0, 1, 2 to the sorted weights before i1, before i2 and after; a negative scale made
    positive by mirroring the levels and the shifts (minus, per group of 8); each group's grid
    entry into index, moved to the best neighbouring entry when off the grid, in which case the
    scale is fitted again. Returns the scale."""
    n = xb.shape[0]
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else 1 if j < i2 else 2
    if scale < 0:
        for j in range(n):
            L[j] = 2 - L[j]
        scale = -scale
        for k in range(n // 8):
            minus[k] = not minus[k]
    on_grid = True
    for k in range(n // 8):
        u = 0
        for i in range(8):
            u |= np.int32(L[8 * k + i]) << (2 * i)
        g = kmap[u]
        if g < 0:
            on_grid = False
            g = _best_neighbour(lists, -1 - g, levels, SHIFTED[1 if minus[k] else 0], xb, weight, 8 * k, scale, L)
        index[k] = g
    if not on_grid:
        sumqx = F32(0.0)
        sumq2 = F32(0.0)
        for k in range(n // 8):
            for i in range(8):
                w = weight[8 * k + i]
                q = _value(minus[k], levels[index[k], i])
                sumqx += w * q * xb[8 * k + i]
                sumq2 += w * q * q
        if sumqx > 0 and sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit(cache=True, inline="always")
def _weights(xb, qw, use_qw, sigma2, weight):
    """Importance times sqrt(sigma2 + x^2); x^2 without an importance matrix (IQ1_M only)."""
    for i in range(xb.shape[0]):
        if use_qw:
            weight[i] = qw[i] * np.sqrt(sigma2 + xb[i] * xb[i])
        else:
            weight[i] = xb[i] * xb[i]


@njit(cache=True, inline="always")
def _abs_max(xb):
    m = abs(xb[0])
    for i in range(1, xb.shape[0]):
        a = abs(xb[i])
        m = m if m > a else a
    return m


@njit(cache=True)
def _sorted_group(xbl, qw, use_qw, sigma2, ib, n, eps, weight, idx):
    """Group ib of n values of the super-block: its weights into weight and its order into idx;
    False (a group skipped) when all its values are below eps in magnitude."""
    xb = xbl[n * ib:n * (ib + 1)]
    _weights(xb, qw[n * ib:n * (ib + 1)], use_qw, sigma2, weight)
    if _abs_max(xb) < eps:
        return False
    _sort_order(xb, idx)
    return True


@njit(cache=True, inline="always")
def _scale_code(id_, scale):
    return max(0, min(7, nearest_int(F32(0.5) * (id_ * scale - F32(1.0)))))


# ---- IQ1_S: d, 32 low bytes of the entries, per 32 weights a word of 4 x 3 high bits, scale, shift ----

@njit(cache=True)
def _iq1_s_block(xbl, qw, levels, kmap, lists, out):
    n = 32
    weight, sumx, sumw = np.empty(n, F32), np.empty(n + 1, F32), np.empty(n + 1, F32)
    idx, L = np.empty(n, np.int32), np.empty(n, np.int8)
    index, minus = np.empty(n // 8, np.int32), np.empty(n // 8, np.bool_)
    scales, shifts_minus = np.zeros(QK_K // n, F32), np.zeros(QK_K // n, np.bool_)
    qh = np.zeros(QK_K // n, np.uint16)
    out[:] = 0
    max_scale = F32(0.0)
    sigma2 = _sigma2(xbl, F32(2.0))
    for ib in range(QK_K // n):
        xb = xbl[n * ib:n * (ib + 1)]
        if not _sorted_group(xbl, qw, True, sigma2, ib, n, GROUP_MAX_EPS_IQ1_S, weight, idx):
            continue
        sumx[0] = 0
        sumw[0] = 0
        for j in range(n):
            i = idx[j]
            sumx[j + 1] = sumx[j] + weight[i] * xb[i]
            sumw[j + 1] = sumw[j] + weight[i]
        best = -FLT_MAX
        scale = F32(0.0)
        i1b, i2b, best_minus = -1, -1, False
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                for m in (False, True):
                    v0, v1, v2 = _value(m, 0), _value(m, 1), _value(m, 2)
                    sumqx = (sumx[i1] - sumx[0]) * v0 + (sumx[i2] - sumx[i1]) * v1 + (sumx[n] - sumx[i2]) * v2
                    sumq2 = ((sumw[i1] - sumw[0]) * v0 * v0 + (sumw[i2] - sumw[i1]) * v1 * v1
                             + (sumw[n] - sumw[i2]) * v2 * v2)
                    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        i1b, i2b, best_minus = i1, i2, m
        if i1b < 0:
            continue
        minus[:] = best_minus
        scale = _place(xb, weight, idx, i1b, i2b, scale, minus, levels, kmap, lists, L, index)
        h = 0
        for k in range(n // 8):
            out[2 + (n // 8) * ib + k] = np.uint8(index[k] & 255)
            h |= (index[k] >> 8) << (3 * k)
        qh[ib] = np.uint16(h)
        scales[ib] = scale
        shifts_minus[ib] = minus[0]
        max_scale = max_scale if max_scale > scale else scale
    if max_scale == 0:
        out[2 + QK_K // 8:] = qh.view(np.uint8)
        return
    d = max_scale / F32(15.0)
    put_f16(out, 0, d * F32(1.125))
    id_ = F32(1.0) / d
    for ib in range(QK_K // n):
        qh[ib] |= np.uint16((_scale_code(id_, scales[ib]) | (8 if shifts_minus[ib] else 0)) << 12)
    out[2 + QK_K // 8:] = qh.view(np.uint8)


# ---- IQ1_M: 32 low bytes of the entries, per 16 weights a byte of 2 x (3 high bits, shift), ----
# ---- 4 words of 4 x 3-bit scales whose top 4 bits hold the half-precision super-block scale ----

@njit(cache=True)
def _iq1_m_block(xbl, qw, use_qw, levels, kmap, lists, out):
    n = 16
    half = n // 2
    weight = np.empty(n, F32)
    px, pw = np.empty((2, n + 1), F32), np.empty((2, n + 1), F32)
    idx, L = np.empty(n, np.int32), np.empty(n, np.int8)
    index, minus = np.empty(n // 8, np.int32), np.empty(n // 8, np.bool_)
    scales, shifts = np.zeros(QK_K // n, F32), np.zeros(QK_K // n, np.int32)
    qs, qh = 0, QK_K // 8
    sc = np.zeros(4, np.uint16)
    out[:] = 0
    max_scale = F32(0.0)
    sigma2 = _sigma2(xbl, F32(2.0))
    p2, m2 = _value(False, 2), _value(True, 2)
    cp1 = _value(False, 0) * _value(False, 0) - _value(False, 1) * _value(False, 1)
    cp2 = _value(False, 1) * _value(False, 1) - _value(False, 2) * _value(False, 2)
    cm1 = _value(True, 0) * _value(True, 0) - _value(True, 1) * _value(True, 1)
    cm2 = _value(True, 1) * _value(True, 1) - _value(True, 2) * _value(True, 2)
    for ib in range(QK_K // n):
        xb = xbl[n * ib:n * (ib + 1)]
        if not _sorted_group(xbl, qw, use_qw, sigma2, ib, n, GROUP_MAX_EPS_IQ1_M, weight, idx):
            continue
        # prefix sums per half: each half of 8 has its own shift (0: +,+  1: +,-  2: -,+  3: -,-)
        px[:, 0] = 0
        pw[:, 0] = 0
        for j in range(n):
            i = idx[j]
            h = 0 if i < half else 1
            px[h, j + 1] = px[h, j] + weight[i] * xb[i]
            px[1 - h, j + 1] = px[1 - h, j]
            pw[h, j + 1] = pw[h, j] + weight[i]
            pw[1 - h, j + 1] = pw[1 - h, j]
        best = -FLT_MAX
        scale = F32(0.0)
        i1b, i2b, best_k = -1, -1, -1
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                sx0 = px[0, i1] + px[0, i2]
                sx1 = px[1, i1] + px[1, i2]
                qx_p0, qx_m0 = px[0, n] * p2 - sx0, px[0, n] * m2 - sx0
                qx_p1, qx_m1 = px[1, n] * p2 - sx1, px[1, n] * m2 - sx1
                q2_p0 = pw[0, n] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                q2_m0 = pw[0, n] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                q2_p1 = pw[1, n] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                q2_m1 = pw[1, n] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                for k in range(4):
                    sumqx = (qx_m0 if k >= 2 else qx_p0) + (qx_m1 if k % 2 else qx_p1)
                    sumq2 = (q2_m0 if k >= 2 else q2_p0) + (q2_m1 if k % 2 else q2_p1)
                    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        i1b, i2b, best_k = i1, i2, k
        if i1b < 0:
            continue
        minus[0] = best_k >= 2
        minus[1] = best_k % 2 == 1
        scale = _place(xb, weight, idx, i1b, i2b, scale, minus, levels, kmap, lists, L, index)
        out[qs + 2 * ib] = np.uint8(index[0] & 255)
        out[qs + 2 * ib + 1] = np.uint8(index[1] & 255)
        out[qh + ib] = np.uint8((index[0] >> 8) | ((index[1] >> 8) << 4))
        scales[ib] = scale
        shifts[ib] = 2 * np.int32(minus[0]) + np.int32(minus[1])
        max_scale = max_scale if max_scale > scale else scale
    if max_scale == 0:
        return
    # the scales at d = max / 15, then d fitted again over the whole super-block (every group,
    # those skipped as entry 0), stored a little larger
    d = max_scale / F32(15.0)
    id_ = F32(1.0) / d
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for ib in range(QK_K // n):
        l = _scale_code(id_, scales[ib])
        sc[ib // 4] |= np.uint16(l << (3 * (ib % 4)))
        out[qh + ib] |= np.uint8((0x08 if shifts[ib] >= 2 else 0) | (0x80 if shifts[ib] % 2 else 0))
        xb = xbl[n * ib:n * (ib + 1)]
        _weights(xb, qw[n * ib:n * (ib + 1)], use_qw, sigma2, weight)
        for k in range(2):
            m = shifts[ib] >= 2 if k == 0 else shifts[ib] % 2 == 1
            g = np.int32(out[qs + 2 * ib + k]) + ((np.int32(out[qh + ib]) << (8 - 4 * k)) & 0x700)
            for i in range(8):
                w = weight[8 * k + i]
                q = _value(m, levels[g, i]) * F32(2 * l + 1)
                sumqx += w * q * xb[8 * k + i]
                sumq2 += w * q * q
    if sumq2 > 0:
        d = sumqx / sumq2
    s = np.int32(f16_bits(F32(d * F32(1.1125))))
    sc[0] |= np.uint16((s & 0x000F) << 12)
    sc[1] |= np.uint16((s & 0x00F0) << 8)
    sc[2] |= np.uint16((s & 0x0F00) << 4)
    sc[3] |= np.uint16(s & 0xF000)
    out[QK_K // 8 + QK_K // 16:] = sc.view(np.uint8)


# ---- rows ----------------------------------------------------------------------------------

@njit(cache=True, parallel=True)
def _iq1_rows(kind, x, qw, use_qw, levels, kmap, lists, out):
    """kind 0, 1: IQ1_S, IQ1_M. Without use_qw (IQ1_M only), qw is a (k,) array never read."""
    nb = x.shape[1] // QK_K
    bb = out.shape[1] // nb
    for r in prange(x.shape[0]):
        for b in range(nb):
            xbl = x[r, b * QK_K:(b + 1) * QK_K]
            qwbl = qw[b * QK_K:(b + 1) * QK_K]
            ob = out[r, b * bb:(b + 1) * bb]
            if kind == 0:
                _iq1_s_block(xbl, qwbl, levels, kmap, lists, ob)
            else:
                _iq1_m_block(xbl, qwbl, use_qw, levels, kmap, lists, ob)


def quantize_iq1(x: np.ndarray, qtype: T, importance: np.ndarray | None) -> np.ndarray:
    """Rows of float32 x (rows, k), k a multiple of 256, -> raw GGUF rows (rows, bytes) of IQ1_S or
    IQ1_M, weighted by the importance matrix's column values (k,). IQ1_S needs one (llama.cpp
    asserts on a missing one); IQ1_M without one weights each weight by x^2, as ggml does
    (llama-quantize still asks for an imatrix for IQ1_M tensors other than the token embeddings
    and the output)."""
    if qtype not in IQ1_TYPES:
        raise ValueError(f"quantize_iq1 quantizes IQ1_S and IQ1_M, not {qtype.name}")
    x, qw, out = checked_rows(x, qtype, importance, required=qtype == T.IQ1_S)
    levels, kmap, lists = tables(qtype)
    _iq1_rows(IQ1_TYPES.index(qtype), x, qw, importance is not None, levels, kmap, lists, out)
    return out
