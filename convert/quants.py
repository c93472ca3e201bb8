"""llama.cpp's quantizers (ggml-quants.c), reimplemented with Numba so that our bytes equal llama.cpp's:
the reference (`_ref`) paths llama-quantize takes without an importance matrix, and the `_impl`
paths it takes with one, whose searches weigh each column by the matrix's value for it.

Byte equality needs llama.cpp's float32 arithmetic step by step: every constant is float32,
integer operands are converted where C converts them, nothing runs with fastmath, and rounding
follows C (nearest_int: to even; roundf: half away from zero; casts: toward zero).
"""
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from numba import njit, prange
from numba.extending import overload

from gguf_io.quant_types import IQ4_VALUES, MXFP4_VALUES
from kernels_cpu.blocks import quantize_q8_0
from kernels_cpu.type_sets import tagged_dtype, tagged_types

from .block_math import GROUP_MAX_EPS, make_qp_quants, nearest_int, put_f16
from .quants_iq1 import quantize_iq1
from .quants_iq2 import quantize_iq2
from .quants_iq3 import quantize_iq3

F32 = np.float32


# ---- 32-weight blocks ----------------------------------------------------------------------

@njit(cache=True)
def _absmax_signed(x):
    amax = F32(0.0)
    mx = F32(0.0)
    for v in x:
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return amax, mx


@njit(cache=True)
def _min_max(x):
    mn = F32(3.4028234663852886e38)
    mx = F32(-3.4028234663852886e38)
    for v in x:
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@njit(cache=True)
def _q4_0(x, out):
    _, mx = _absmax_signed(x)
    d = mx / F32(-8.0)
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    put_f16(out, 0, d)
    for j in range(16):
        a = min(15, np.int32(x[j] * inv + F32(8.5)))
        b = min(15, np.int32(x[j + 16] * inv + F32(8.5)))
        out[2 + j] = np.uint8(a | (b << 4))


@njit(cache=True)
def _q4_1(x, out):
    mn, mx = _min_max(x)
    d = (mx - mn) / F32(15.0)
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    put_f16(out, 0, d)
    put_f16(out, 2, mn)
    for j in range(16):
        a = min(15, np.int32((x[j] - mn) * inv + F32(0.5)))
        b = min(15, np.int32((x[j + 16] - mn) * inv + F32(0.5)))
        out[4 + j] = np.uint8(a | (b << 4))


@njit(cache=True)
def _q5_pack(a, b, j, out, qs_at, qh):
    out[qs_at + j] = np.uint8((a & 15) | ((b & 15) << 4))
    return qh | (np.uint32((a >> 4) & 1) << j) | (np.uint32((b >> 4) & 1) << (j + 16))


@njit(cache=True)
def _store_u32(out, at, v):
    for i in range(4):
        out[at + i] = np.uint8((v >> (8 * i)) & 0xFF)


@njit(cache=True)
def _q5_0(x, out):
    _, mx = _absmax_signed(x)
    d = mx / F32(-16.0)
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    put_f16(out, 0, d)
    qh = np.uint32(0)
    for j in range(16):
        a = min(31, np.int32(x[j] * inv + F32(16.5)))
        b = min(31, np.int32(x[j + 16] * inv + F32(16.5)))
        qh = _q5_pack(a, b, j, out, 6, qh)
    _store_u32(out, 2, qh)


@njit(cache=True)
def _q5_1(x, out):
    mn, mx = _min_max(x)
    d = (mx - mn) / F32(31.0)
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    put_f16(out, 0, d)
    put_f16(out, 2, mn)
    qh = np.uint32(0)
    for j in range(16):
        a = np.int32((x[j] - mn) * inv + F32(0.5)) & 0xFF
        b = np.int32((x[j + 16] - mn) * inv + F32(0.5)) & 0xFF
        qh = _q5_pack(a, b, j, out, 8, qh)
    _store_u32(out, 4, qh)


# The importance-weighted 32-weight blocks (quantize_row_q4_0_impl ...): each weight's error
# weighed by its column's importance times sqrt(row_sigma2 + x^2), row_sigma2 the row's mean square;
# Q4_0 and Q5_0 by make_qx_quants' symmetric search, Q4_1 and Q5_1 by make_qkx3_quants' affine one.

@njit(cache=True)
def _symmetric_weighted(x, qw, row_sigma2, nmax, out):
    """Q4_0 / Q5_0 (nmax 8 / 16): the scale stored, the codes (0..2 nmax - 1) returned."""
    w = np.empty(32, np.float32)
    L = np.empty(32, np.int32)
    _importance_weights(x, qw, row_sigma2, w)
    put_f16(out, 0, _make_qx_quants(x, nmax, L, w))
    return L


@njit(cache=True)
def _affine_weighted(x, qw, row_sigma2, nmax, out):
    """Q4_1 / Q5_1 (nmax 15 / 31): the scale and the minimum stored, the codes returned."""
    w = np.empty(32, np.float32)
    L = np.empty(32, np.int32)
    Laux = np.empty(32, np.int32)
    _importance_weights(x, qw, row_sigma2, w)
    d, the_min = _make_qkx2_quants(x, w, nmax, L, Laux, F32(-0.9), F32(0.05), 36, False, True)
    put_f16(out, 0, d)
    put_f16(out, 2, -the_min)
    return L


@njit(cache=True)
def _q4_0_weighted(x, qw, row_sigma2, out):
    L = _symmetric_weighted(x, qw, row_sigma2, 8, out)
    for j in range(16):
        out[2 + j] = np.uint8(L[j] | (L[j + 16] << 4))


@njit(cache=True)
def _q4_1_weighted(x, qw, row_sigma2, out):
    L = _affine_weighted(x, qw, row_sigma2, 15, out)
    for j in range(16):
        out[4 + j] = np.uint8(L[j] | (L[j + 16] << 4))


@njit(cache=True)
def _q5_pack_all(L, out, qs_at, qh_at):
    qh = np.uint32(0)
    for j in range(16):
        qh = _q5_pack(L[j], L[j + 16], j, out, qs_at, qh)
    _store_u32(out, qh_at, qh)


@njit(cache=True)
def _q5_0_weighted(x, qw, row_sigma2, out):
    _q5_pack_all(_symmetric_weighted(x, qw, row_sigma2, 16, out), out, 6, 2)


@njit(cache=True)
def _q5_1_weighted(x, qw, row_sigma2, out):
    _q5_pack_all(_affine_weighted(x, qw, row_sigma2, 31, out), out, 8, 4)


@njit(cache=True)
def _q8_0(x, out):
    put_f16(out, 0, quantize_q8_0(x, out[2:34]))


_FP4_VALUES = np.array(MXFP4_VALUES, dtype=np.float32)


@njit(cache=True)
def _nearest_fp4(x, d):
    """The code of the MXFP4 value (kvalues_mxfp4 * d) nearest x, the first of equals."""
    best, best_err = 0, abs(_FP4_VALUES[0] * d - x)
    for i in range(1, 16):
        err = abs(_FP4_VALUES[i] * d - x)
        if err < best_err:
            best, best_err = i, err
    return best


@njit(cache=True)
def _mxfp4(x, out):
    amax, _ = _absmax_signed(x)
    e = 0
    if amax > 0:  # floorf(log2f(amax)) - 2 + 127, cast to uint8 as x86 does (through int32)
        e = np.int32(np.floor(F32(np.log2(np.float64(amax)))) - F32(2.0) + F32(127.0)) & 0xFF
    d = F32(2.0 ** (e - 128))  # (GGML_E8M0_TO_FP32_HALF: a power of two, exact)
    out[0] = np.uint8(e)
    for j in range(16):
        out[1 + j] = np.uint8(_nearest_fp4(x[j], d) | (_nearest_fp4(x[j + 16], d) << 4))


# ---- K-quant helpers (make_qx_quants, make_q3_quants, make_qkx2_quants) -----------------------

@njit(cache=True)
def _make_qx_quants(x, nmax, L, weights):
    """make_qx_quants with rmse_type 1: the symmetric search, each weight's error weighed by
    weights (x^2 in Q6_K's reference; an importance matrix's otherwise)."""
    n = x.size
    amax, mx = _absmax_signed(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return F32(0.0)
    fn = F32(nmax)
    iscale = -fn / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = weights[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fn + F32(0.1) * F32(step)) / mx
        sumlx = F32(0.0)
        suml2 = F32(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = weights[i]
            sumlx += w * x[i] * F32(l)
            suml2 += w * F32(l) * F32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _make_q3_quants(x, nmax, L):
    """make_q3_quants with do_rmse: start from the nearest grid, then coordinate descent."""
    n = x.size
    amax, mx = _absmax_signed(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return F32(0.0)
    iscale = -F32(nmax) / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F32(L[i])
            if slx > 0:
                sl2 = suml2 - w * F32(L[i]) * F32(L[i])
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True, error_model="numpy")  # (a zero sum of weights divides as C does: inf or NaN)
def _make_qkx2_quants(x, weights, nmax, L, Laux, rmin, rdelta, nstep, use_mad, capped):
    """Affine (scale, min) search; returns (scale, -min). capped: make_qkx3_quants's search (the
    _impl quantizers'), which caps each scaled weight at nmax before rounding it (a weight scaled
    to +inf takes nmax there, 0 in make_qkx2_quants)."""
    n = x.size
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if mn > 0:
        mn = F32(0.0)
    if mx == mn:
        L[:] = 0
        return F32(0.0), -mn
    iscale = F32(nmax) / (mx - mn)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        L[i] = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        diff = scale * F32(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            if capped:
                v = iscale * (x[i] - mn)
                l = nearest_int(min(v, F32(nmax))) if v > 0 else 0
            else:
                l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            w = weights[i]
            sum_l += w * F32(l)
            sum_l2 += w * F32(l) * F32(l)
            sum_xl += w * F32(l) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                L[:n] = Laux[:n]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True)
def _sum_squares(x):
    s = F32(0.0)
    for v in x:
        s += v * v
    return s


@njit(cache=True)
def _importance_weights(x, qw, sigma2, weights):
    """The weights the _impl quantizers search with: each column's importance qw times
    sqrt(sigma2 + x^2); returns their sum."""
    total = F32(0.0)
    for i in range(x.size):
        weights[i] = qw[i] * np.sqrt(sigma2 + x[i] * x[i])
        total += weights[i]
    return total


@njit(cache=True)
def _pack_2bit_planes(L, out, at):
    """Four 2-bit values per byte: byte l of each 128-weight half holds l, l+32, l+64, l+96."""
    for j in range(0, 256, 128):
        for l in range(32):
            out[at + j // 4 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4)
                                            | (L[j + l + 96] << 6))


# ---- K-quant super-blocks (256 weights) ------------------------------------------------------
# Each type's reference quantizer (x, out) and its importance-weighted one (x, qw, row_sigma2, out:
# qw the block's columns' importance; row_sigma2 unused, the super-block has its own) share the
# packing of the codes and scales they choose.

@njit(cache=True)
def _q2_k_codes(x, sc, d, dmin, L, out):
    """Q2_K's 16 scale bytes sc (4-bit scale, 4-bit min), the weights requantized to them (a
    sub-block of scale 0 keeps the search's codes) and packed."""
    for j in range(16):
        sc[j] &= 0xFF
        out[j] = np.uint8(sc[j])
        dl = d * F32(sc[j] & 15)
        if dl == 0:
            continue
        dm = dmin * F32(sc[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int((x[16 * j + i] + dm) / dl)))
    _pack_2bit_planes(L, out, 16)


@njit(cache=True)
def _q2_k(x, out):  # scales[16] qs[64] d dmin
    L = np.zeros(256, np.int32)
    Laux = np.zeros(16, np.int32)
    scales = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        scales[j], mins[j] = _make_qkx2_quants(xs, np.abs(xs), 3, L[16 * j:16 * j + 16], Laux,
                                               F32(-0.5), F32(0.1), 15, True, False)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    sc = np.zeros(16, np.int32)
    if max_scale > 0:
        iscale = F32(15.0) / max_scale
        for j in range(16):
            sc[j] = nearest_int(iscale * scales[j])
        d = put_f16(out, 80, max_scale / F32(15.0))
    else:
        d = put_f16(out, 80, F32(0.0))
    if max_min > 0:
        iscale = F32(15.0) / max_min
        for j in range(16):
            sc[j] |= nearest_int(iscale * mins[j]) << 4
        dmin = put_f16(out, 82, max_min / F32(15.0))
    else:
        dmin = put_f16(out, 82, F32(0.0))
    _q2_k_codes(x, sc, d, dmin, L, out)


@njit(cache=True)
def _q2_k_weighted(x, qw, row_sigma2, out):
    L = np.zeros(256, np.int32)
    Laux = np.zeros(16, np.int32)
    weights = np.empty(16, np.float32)
    scales = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    sigma2 = _sum_squares(x) / F32(256.0)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        sw[j] = _importance_weights(xs, qw[16 * j:16 * j + 16], sigma2, weights)
        scales[j], mins[j] = _make_qkx2_quants(xs, weights, 3, L[16 * j:16 * j + 16], Laux,
                                               F32(-0.9), F32(0.05), 36, False, True)
    ls = np.zeros(16, np.uint8)
    lm = np.zeros(16, np.uint8)
    d = put_f16(out, 80, make_qp_quants(scales, 15, ls, sw))
    dmin = put_f16(out, 82, make_qp_quants(mins, 15, lm, sw))
    sc = np.zeros(16, np.int32)
    for j in range(16):
        sc[j] = np.int32(ls[j]) | (np.int32(lm[j]) << 4)
    _q2_k_codes(x, sc, d, dmin, L, out)


@njit(cache=True)
def _q3_k_codes(x, ls, d, L, out):
    """Q3_K's 16 6-bit scales ls (stored plus 32) packed in out[96:108], d stored, the weights
    requantized to the scales (a sub-block of scale 0 keeps the search's codes) and packed."""
    packed = np.zeros(12, np.int32)
    for j in range(16):
        l = ls[j]
        if j < 8:
            packed[j] = l & 15
        else:
            packed[j - 8] |= (l & 15) << 4
        packed[8 + j % 4] |= (l >> 4) << (2 * (j // 4))
    d = put_f16(out, 108, d)
    for j in range(12):
        out[96 + j] = np.uint8(packed[j] & 0xFF)
    for j in range(16):
        low = packed[j] & 15 if j < 8 else (packed[j - 8] & 0xFF) >> 4
        s = (low | ((((packed[8 + j % 4] & 0xFF) >> (2 * (j // 4))) & 3) << 4)) - 32
        dl = d * F32(s)
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(x[16 * j + i] / dl))) + 4
    for i in range(32):
        out[i] = 0
    for j in range(256):  # high bit of weight j goes to hmask[j % 32], bit j // 32
        if L[j] > 3:
            out[j % 32] |= np.uint8(1 << (j // 32))
            L[j] -= 4
    _pack_2bit_planes(L, out, 32)


@njit(cache=True)
def _q3_k(x, out):  # hmask[32] qs[64] scales[12] d
    L = np.zeros(256, np.int32)
    scales = np.zeros(16, np.float32)
    amax = F32(0.0)
    max_scale = F32(0.0)
    for j in range(16):
        scales[j] = _make_q3_quants(x[16 * j:16 * j + 16], 4, L[16 * j:16 * j + 16])
        if abs(scales[j]) > amax:
            amax = abs(scales[j])
            max_scale = scales[j]
    ls = np.zeros(16, np.int32)
    d = F32(0.0)
    if max_scale != 0:
        iscale = F32(-32.0) / max_scale
        for j in range(16):
            ls[j] = max(-32, min(31, np.int32(np.int8(nearest_int(iscale * scales[j]) & 0xFF)))) + 32
        d = F32(1.0) / iscale
    _q3_k_codes(x, ls, d, L, out)


@njit(cache=True)
def _q3_k_weighted(x, qw, row_sigma2, out):
    L = np.zeros(256, np.int32)
    weights = np.empty(16, np.float32)
    scales = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    sigma2 = F32(2.0) * _sum_squares(x) / F32(256.0)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        sw[j] = _importance_weights(xs, qw[16 * j:16 * j + 16], sigma2, weights)
        scales[j] = _make_qx_quants(xs, 4, L[16 * j:16 * j + 16], weights)
    ls = np.zeros(16, np.int32)
    d = _make_qx_quants(scales, 32, ls, sw)
    _q3_k_codes(x, ls, d, L, out)


@njit(cache=True)
def _q4_k_pack(L, out):
    for j in range(0, 256, 64):
        for l in range(32):
            out[16 + j // 2 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 4))


@njit(cache=True)
def _q5_k_pack(L, out):
    for i in range(32):
        out[16 + i] = 0
    for c, n in enumerate(range(0, 256, 64)):
        for j in range(32):
            l1 = L[n + j]
            l2 = L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                out[16 + j] |= np.uint8(1 << (2 * c))
            if l2 > 15:
                l2 -= 16
                out[16 + j] |= np.uint8(2 << (2 * c))
            out[48 + n // 2 + j] = np.uint8(l1 | (l2 << 4))


@njit(cache=True)
def _k4_codes(x, nmax, ls, lm, d, dmin, L, out):
    """Q4_K/Q5_K (nmax 15/31): 8 sub-blocks' 6-bit scales ls and mins lm packed in out[4:16] (as
    uint8, as llama.cpp stores them), d and dmin stored, the weights requantized to the packed
    scales (a sub-block of scale 0 keeps the search's codes) and packed."""
    q = np.zeros(12, np.int32)
    for j in range(8):
        if j < 4:
            q[j] = ls[j]
            q[j + 4] = lm[j]
        else:
            q[j + 4] = (ls[j] & 15) | ((lm[j] & 15) << 4)
            q[j - 4] = (q[j - 4] | ((ls[j] >> 4) << 6)) & 0xFF
            q[j] = (q[j] | ((lm[j] >> 4) << 6)) & 0xFF
    for j in range(12):
        out[4 + j] = np.uint8(q[j] & 0xFF)
    d = put_f16(out, 0, d)
    dmin = put_f16(out, 2, dmin)
    for j in range(8):  # (get_scale_min_k4)
        if j < 4:
            sc, m = q[j] & 63, q[j + 4] & 63
        else:
            sc, m = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
        dl = d * F32(sc)
        if dl == 0:
            continue
        dm = dmin * F32(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int((x[32 * j + i] + dm) / dl)))
    if nmax == 15:
        _q4_k_pack(L, out)
    else:
        _q5_k_pack(L, out)


@njit(cache=True)
def _k4_scales(x, nmax, rmin, nstep, L, out):
    """Q4_K/Q5_K's reference: 8 affine sub-blocks of 32, their scales and mins each a 6-bit
    multiple of the largest / 63."""
    Laux = np.zeros(32, np.int32)
    weights = np.zeros(32, np.float32)
    scales = np.zeros(8, np.float32)
    mins = np.zeros(8, np.float32)
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        av_x = np.sqrt(_sum_squares(xs) / F32(32.0))
        for i in range(32):
            weights[i] = av_x + abs(xs[i])
        scales[j], mins[j] = _make_qkx2_quants(xs, weights, nmax, L[32 * j:32 * j + 32], Laux,
                                               rmin, F32(0.1), nstep, False, False)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
    ls = np.zeros(8, np.int32)
    lm = np.zeros(8, np.int32)
    for j in range(8):
        ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
    _k4_codes(x, nmax, ls, lm, max_scale / F32(63.0), max_min / F32(63.0), L, out)


@njit(cache=True)
def _k4_scales_weighted(x, qw, nmax, L, out):
    """Q4_K/Q5_K's importance-weighted search: scales and mins as codes of make_qp_quants."""
    Laux = np.zeros(32, np.int32)
    weights = np.empty(32, np.float32)
    scales = np.zeros(8, np.float32)
    mins = np.zeros(8, np.float32)
    sw = np.zeros(8, np.float32)
    sigma2 = F32(2.0) * _sum_squares(x) / F32(256.0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sw[j] = _importance_weights(xs, qw[32 * j:32 * j + 32], sigma2, weights)
        scales[j], mins[j] = _make_qkx2_quants(xs, weights, nmax, L[32 * j:32 * j + 32], Laux,
                                               F32(-0.9), F32(0.05), 36, False, True)
    ls8 = np.zeros(8, np.uint8)
    lm8 = np.zeros(8, np.uint8)
    d = make_qp_quants(scales, 63, ls8, sw)
    dmin = make_qp_quants(mins, 63, lm8, sw)
    cap = 63 if nmax == 31 else 255  # (Q5_K caps them at 63, Q4_K does not)
    ls = np.zeros(8, np.int32)
    lm = np.zeros(8, np.int32)
    for j in range(8):
        ls[j] = min(cap, np.int32(ls8[j]))
        lm[j] = min(cap, np.int32(lm8[j]))
    _k4_codes(x, nmax, ls, lm, d, dmin, L, out)


@njit(cache=True)
def _q4_k(x, out):  # d dmin scales[12] qs[128]
    _k4_scales(x, 15, F32(-1.0), 20, np.zeros(256, np.int32), out)


@njit(cache=True)
def _q4_k_weighted(x, qw, row_sigma2, out):
    _k4_scales_weighted(x, qw, 15, np.zeros(256, np.int32), out)


@njit(cache=True)
def _q5_k(x, out):  # d dmin scales[12] qh[32] qs[128]
    _k4_scales(x, 31, F32(-0.5), 15, np.zeros(256, np.int32), out)


@njit(cache=True)
def _q5_k_weighted(x, qw, row_sigma2, out):
    _k4_scales_weighted(x, qw, 31, np.zeros(256, np.int32), out)


@njit(cache=True)
def _q6_k_scales(x, qw, out):  # ql[128] qh[64] scales[16] d
    """Q6_K with the weights of each weight's error in its 16 sub-blocks' searches: x^2 in the
    reference, the columns' importance (as they are) with an importance matrix."""
    L = np.zeros(256, np.int32)
    scales = np.zeros(16, np.float32)
    max_scale = F32(0.0)
    max_abs = F32(0.0)
    for j in range(16):
        scales[j] = _make_qx_quants(x[16 * j:16 * j + 16], 32, L[16 * j:16 * j + 16], qw[16 * j:16 * j + 16])
        if abs(scales[j]) > max_abs:
            max_abs = abs(scales[j])
            max_scale = scales[j]
    out[:] = 0
    if max_abs < GROUP_MAX_EPS:
        return
    iscale = F32(-128.0) / max_scale
    d = put_f16(out, 208, F32(1.0) / iscale)
    for j in range(16):
        s = np.int8(min(127, nearest_int(iscale * scales[j])) & 0xFF)
        out[192 + j] = np.uint8(np.int32(s) & 0xFF)
        dl = d * F32(s)
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(x[16 * j + i] / dl))) + 32
    for half in range(2):
        j = half * 128
        for l in range(32):
            out[half * 64 + l] = np.uint8((L[j + l] & 15) | ((L[j + l + 64] & 15) << 4))
            out[half * 64 + l + 32] = np.uint8((L[j + l + 32] & 15) | ((L[j + l + 96] & 15) << 4))
            out[128 + half * 32 + l] = np.uint8((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2)
                                                | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6))


@njit(cache=True)
def _q6_k(x, out):
    _q6_k_scales(x, x * x, out)


@njit(cache=True)
def _q6_k_weighted(x, qw, row_sigma2, out):
    _q6_k_scales(x, qw, out)


# ---- IQ4_NL and IQ4_XS (quantize_row_iq4_nl_impl as quantize_iq4_nl/_xs call it: seven tries
# either side of the first scale; each weight's error weighed by x^2, or with an importance matrix
# by its column's importance times sqrt(sigma2 + x^2)) -------------------------------------------

_IQ4 = np.array(IQ4_VALUES, dtype=np.int8)
_IQ4_TRIES = 7


@njit(cache=True, inline="always")
def _iq4_index(x):
    """best_index_int8: the index of the IQ4 value nearest x, the upper of equals."""
    if x <= F32(_IQ4[0]):
        return 0
    if x >= F32(_IQ4[15]):
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < F32(_IQ4[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - F32(_IQ4[hi - 1]) < F32(_IQ4[hi]) - x else hi


@njit(cache=True, inline="always")
def _iq4_sums(x, w, inv):
    """(sum w q x, sum w q^2) over x's values q of the IQ4 values nearest x * inv."""
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for i in range(x.size):
        q = F32(_IQ4[_iq4_index(inv * x[i])])
        wq = w[i] * q
        sumqx += wq * x[i]
        sumq2 += wq * q
    return sumqx, sumq2


@njit(cache=True)
def _iq4_scale(x, w):
    """The scale of a 32-weight block: the best fit of the values nearest x / d over d from max /
    -127 and the tries around it (0 for a block of zeros)."""
    amax, mx = _absmax_signed(x)
    if amax < GROUP_MAX_EPS:
        return F32(0.0)
    d = -mx / F32(_IQ4[0])
    sumqx, sumq2 = _iq4_sums(x, w, F32(1.0) / d)
    d = sumqx / sumq2 if sumq2 > 0 else F32(0.0)
    best = d * sumqx
    for t in range(-_IQ4_TRIES, _IQ4_TRIES + 1):
        sumqx, sumq2 = _iq4_sums(x, w, F32(t + np.int32(_IQ4[0])) / mx)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True, inline="always")
def _iq4_codes(x, d, out, at):
    """x's 32 values as the codes of their IQ4 values nearest x / d, packed as Q4_0's nibbles."""
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    for j in range(16):
        out[at + j] = np.uint8(_iq4_index(inv * x[j]) | (_iq4_index(inv * x[j + 16]) << 4))


@njit(cache=True)
def _iq4_nl_scaled(x, w, out):
    d = _iq4_scale(x, w)
    put_f16(out, 0, d)
    _iq4_codes(x, d, out, 2)


@njit(cache=True)
def _iq4_nl(x, out):
    _iq4_nl_scaled(x, x * x, out)


@njit(cache=True)
def _iq4_weights(x, qw):
    """The weights of a (super-)block with an importance matrix, sigma2 twice its mean square."""
    w = np.empty(x.size, np.float32)
    _importance_weights(x, qw, _sum_squares(x) * F32(2.0 / x.size), w)
    return w


@njit(cache=True)
def _iq4_nl_weighted(x, qw, row_sigma2, out):
    _iq4_nl_scaled(x, _iq4_weights(x, qw), out)


@njit(cache=True)
def _iq4_xs_scaled(x, w, out):
    """Eight block scales, then a super-block scale d = -(the one of largest magnitude) / 32 and
    6-bit block scales l in -32..31 (stored plus 32) with codes nearest x / (d * l)."""
    scales = np.empty(8, dtype=np.float32)
    max_scale = F32(0.0)
    for g in range(8):
        scales[g] = _iq4_scale(x[32 * g:32 * g + 32], w[32 * g:32 * g + 32])
        if abs(scales[g]) > abs(max_scale):
            max_scale = scales[g]
    d = -max_scale / F32(32.0)
    put_f16(out, 0, d)
    inv = F32(1.0) / d if d != 0 else F32(0.0)
    high = 0
    for g in range(8):
        l = max(-32, min(31, nearest_int(inv * scales[g])))
        _iq4_codes(x[32 * g:32 * g + 32], d * F32(l), out, 8 + 16 * g)
        if g % 2 == 0:
            out[4 + g // 2] = np.uint8((l + 32) & 15)
        else:
            out[4 + g // 2] |= np.uint8(((l + 32) & 15) << 4)
        high |= ((l + 32) >> 4) << (2 * g)
    out[2] = np.uint8(high & 0xFF)
    out[3] = np.uint8(high >> 8)


@njit(cache=True)
def _iq4_xs(x, out):
    _iq4_xs_scaled(x, x * x, out)


@njit(cache=True)
def _iq4_xs_weighted(x, qw, row_sigma2, out):
    _iq4_xs_scaled(x, _iq4_weights(x, qw), out)


# ---- ternary types (TQ1_0, TQ2_0): each weight is -1, 0 or 1 times the block's absolute max ----

@njit(cache=True, inline="always")
def _ternary(v):
    """lroundf(v) + 1: 0, 1 or 2 for v about -1, 0, 1, rounding halves away from zero. A value that
    is not finite (v = x / amax where amax is subnormal) gives 1: x86's lroundf returns LONG_MIN,
    which llama.cpp's int keeps as 0."""
    if not np.isfinite(v):
        return np.int32(1)
    t = np.trunc(v)
    if abs(v - t) >= F32(0.5):
        t += np.sign(v)
    return np.int32(t) + 1


@njit(cache=True)
def _ternary_inverse(x, out, at):
    """Store the block's d, its absolute max, at out[at:at+2]; return 1 / d (of d unrounded, as
    ggml), or 0 for a block of zeros."""
    amax, _ = _absmax_signed(x)
    put_f16(out, at, amax)
    return F32(1.0) / amax if amax != 0 else F32(0.0)


@njit(cache=True, inline="always")
def _base3_byte(x, first, stride, n, id):
    """Digits of x[first + stride * i] (i < n, the first most significant) as a fraction of 3^5
    rounded up to a byte, which decoders read back digit by digit (* 3^i wrapping at 256, * 3 >> 8)."""
    q = 0
    for i in range(n):
        q = q * 3 + _ternary(x[first + stride * i] * id)
    for _ in range(n, 5):
        q *= 3
    return np.uint8((q * 256 + 242) // 243)


@njit(cache=True)
def _tq1_0(x, out):  # qs[48] qh[4] d: five weights a byte (32 bytes, then 16), four in each qh byte
    id = _ternary_inverse(x, out, 52)
    for m in range(32):
        out[m] = _base3_byte(x, m, 32, 5, id)
    for m in range(16):
        out[32 + m] = _base3_byte(x, 160 + m, 16, 5, id)
    for m in range(4):
        out[48 + m] = _base3_byte(x, 240 + m, 4, 4, id)


@njit(cache=True)
def _tq2_0(x, out):  # qs[64] d: weight 128 h + 32 n + m in bits 2n of byte 32 h + m, as value + 1
    id = _ternary_inverse(x, out, 64)
    for h in range(2):
        for m in range(32):
            q = 0
            for n in range(4):
                q |= _ternary(x[128 * h + 32 * n + m] * id) << (2 * n)
            out[32 * h + m] = np.uint8(q)


# block quantizer by type: compiled only into the row loops of the types a conversion writes
BLOCK_QUANTIZERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.MXFP4: _mxfp4,
                    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
                    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0}
# row quantizer (rows, type, importance of their columns or None) by type: the i-quants with
# grids, whose searches use tables built once per type
ROW_QUANTIZERS = {T.IQ1_S: quantize_iq1, T.IQ1_M: quantize_iq1, T.IQ2_XXS: quantize_iq2, T.IQ2_XS: quantize_iq2,
                  T.IQ2_S: quantize_iq2, T.IQ3_XXS: quantize_iq3, T.IQ3_S: quantize_iq3}
# importance-weighted block quantizer (x, qw, row_sigma2, out) by type: the types whose llama.cpp
# quantizer reads an importance matrix (Q8_0's and MXFP4's ignore it)
WEIGHTED_QUANTIZERS = {T.Q4_0: _q4_0_weighted, T.Q4_1: _q4_1_weighted, T.Q5_0: _q5_0_weighted,
                       T.Q5_1: _q5_1_weighted, T.Q2_K: _q2_k_weighted, T.Q3_K: _q3_k_weighted,
                       T.Q4_K: _q4_k_weighted, T.Q5_K: _q5_k_weighted, T.Q6_K: _q6_k_weighted,
                       T.IQ4_NL: _iq4_nl_weighted, T.IQ4_XS: _iq4_xs_weighted}


def reads_importance(qtype: T) -> bool:
    """Whether an importance matrix changes how this type is quantized."""
    return qtype in ROW_QUANTIZERS or qtype in WEIGHTED_QUANTIZERS


def _quantize_block(tag, x, out):
    """x (one block) into out as the type tag's dtype names, in compiled code only."""
    raise NotImplementedError


@overload(_quantize_block)
def _typed_quantize_block(tag, x, out):
    (qtype,) = tagged_types(tag)
    quantize_block = BLOCK_QUANTIZERS[qtype]
    return lambda tag, x, out: quantize_block(x, out)


def _quantize_weighted_block(tag, x, qw, row_sigma2, out):
    """x (one block) into out as the type tag's dtype names, weighed by qw, in compiled code only."""
    raise NotImplementedError


@overload(_quantize_weighted_block)
def _typed_quantize_weighted_block(tag, x, qw, row_sigma2, out):
    (qtype,) = tagged_types(tag)
    quantize_block = WEIGHTED_QUANTIZERS[qtype]
    return lambda tag, x, qw, row_sigma2, out: quantize_block(x, qw, row_sigma2, out)


# The type travels as an empty array whose dtype names it (type_sets): its Numba type differs per
# type, so each type is its own compiled and cached signature. (A literal type argument went
# through Numba's typing at every call, some 20 ms, before it found the cached code: most of a
# small model's quantizing time.)
_TAG = np.dtype([("unused", np.uint8)])


@njit(cache=True, parallel=True)
def _quantize_rows(tag, x, out, block, block_bytes):
    for r in prange(x.shape[0]):
        for b in range(x.shape[1] // block):
            _quantize_block(tag, x[r, b * block:(b + 1) * block], out[r, b * block_bytes:(b + 1) * block_bytes])


@njit(cache=True, parallel=True)
def _quantize_rows_weighted(tag, x, qw, rows_per_group, out, block, block_bytes):
    """Row r weighed by qw[r // rows_per_group] (a mixture's experts: each its own importance)."""
    for r in prange(x.shape[0]):
        w = qw[r // rows_per_group]
        row_sigma2 = _sum_squares(x[r]) / F32(x.shape[1])
        for b in range(x.shape[1] // block):
            _quantize_weighted_block(tag, x[r, b * block:(b + 1) * block], w[b * block:(b + 1) * block], row_sigma2,
                                     out[r, b * block_bytes:(b + 1) * block_bytes])


def _tag(qtype) -> np.ndarray:
    return np.empty(0, dtype=tagged_dtype(_TAG, [qtype]))


def quantizers_compiled(qtypes, weighted: bool = False) -> bool:
    """False when quantizing to one of qtypes (weighted: with an importance matrix) would compile
    its quantizer first (seconds each: no entry for that type in Numba's cache index of the row
    loop yet)."""
    if weighted:
        rows, qtypes = _quantize_rows_weighted, [t for t in qtypes if t in WEIGHTED_QUANTIZERS]
    else:
        rows, qtypes = _quantize_rows, [t for t in qtypes if t in BLOCK_QUANTIZERS]
    try:
        index = rows._cache._cache_file._load_index()  # (Numba's own cache index)
    except (AttributeError, OSError, EOFError, ValueError):
        return True
    compiled = {tagged_types(key[0][0]) for key in index}
    return all((t,) in compiled for t in qtypes)


def quantize(x: np.ndarray, qtype: T, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows of float32 x (N, K) -> raw GGUF rows (N, bytes per row) of type qtype. imatrix: the
    importance of each of the K columns, (K,), or (G, K) for G equal groups of rows (a mixture's
    experts), as llama.cpp's quantizers take it (the types that ignore one quantize without)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    if qtype == T.F32:
        return x.view(np.uint8).copy()
    if qtype == T.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype == T.BF16:  # round to nearest even on the upper 16 bits, as ggml does (NaN kept quiet)
        bits = x.view(np.uint32)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(x), ((bits >> 16) | 64).astype(np.uint16), rounded)
        return rounded.view(np.uint8)
    if qtype in ROW_QUANTIZERS:
        if imatrix is None:
            return ROW_QUANTIZERS[qtype](x, qtype, None)
        qw = _importance_groups(x, imatrix)
        rows = x.shape[0] // qw.shape[0]
        return np.concatenate([ROW_QUANTIZERS[qtype](x[g * rows:(g + 1) * rows], qtype, qw[g]) for g in range(len(qw))])
    if qtype not in BLOCK_QUANTIZERS:
        raise ValueError(f"cannot quantize to {qtype.name}")
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if x.shape[1] % block:
        raise ValueError(f"row length {x.shape[1]} is not a multiple of the {qtype.name} block size {block}")
    out = np.zeros((x.shape[0], x.shape[1] // block * block_bytes), dtype=np.uint8)
    if imatrix is None or qtype not in WEIGHTED_QUANTIZERS:
        _quantize_rows(_tag(qtype), x, out, block, block_bytes)
        return out
    qw = _importance_groups(x, imatrix)
    _quantize_rows_weighted(_tag(qtype), x, qw, x.shape[0] // qw.shape[0], out, block, block_bytes)
    return out


def _importance_groups(x: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """The importance matrix as (G, K): a vector for each of G equal groups of x's rows."""
    size = np.size(imatrix)
    if size == 0 or size % x.shape[1] or x.shape[0] % (size // x.shape[1]):
        raise ValueError(f"an importance matrix of {size} values does not fit {x.shape[0]} rows of {x.shape[1]} columns")
    return np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1, x.shape[1])
