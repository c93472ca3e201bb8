"""The float steps llama.cpp's quantizers share (ggml-quants.c): its rounding to the nearest
integer, a float16 scale stored as it reads it back, and make_qp_quants' search for the scale of
non-negative values."""
import numpy as np
from numba import njit

from kernels_cpu.blocks import F16_TABLE
from kernels_cpu.intrinsics import f16_bits, f32_bits

F32 = np.float32
FLT_MAX = F32(3.4028234663852886e38)
GROUP_MAX_EPS = F32(1e-15)


@njit(cache=True, inline="always")
def nearest_int(f):
    """ggml's nearest_int: the low mantissa bits of f + 1.5 * 2^23, which round to even where
    |f| < 2^22 (and wrap past it, as llama.cpp's do)."""
    return (f32_bits(F32(F32(f) + F32(12582912.0))) & 0x007FFFFF) - 0x00400000


@njit(cache=True, inline="always")
def put_f16(out, at, f):
    """Store f as half at out[at:at+2]; return the value the half holds (GGML_FP16_TO_FP32 of it).
    (LLVM's conversion: F16C's on x86, as llama.cpp's GGML_FP32_TO_FP16.)"""
    h = f16_bits(F32(f))
    out[at] = np.uint8(h & 0xFF)
    out[at + 1] = np.uint8(h >> 8)
    return F16_TABLE[np.int32(h)]



@njit(cache=True)
def make_qp_quants(x, nmax, L, weights):
    """make_qp_quants: codes 0..nmax (L, uint8 as llama.cpp stores them) for the non-negative x (a
    super-block's scales or mins) and the scale they share, weighed by weights; returns the scale."""
    n = x.size
    mx = F32(0.0)
    for v in x:
        mx = max(mx, v)
    if mx < GROUP_MAX_EPS:
        L[:] = 0
        return F32(0.0)
    iscale = F32(nmax) / mx
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        L[i] = np.uint8(nearest_int(iscale * x[i]) & 0xFF)
        diff = x[i] - scale * F32(L[i])
        best_mse += weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = (F32(0.1) * F32(step) + F32(nmax)) / mx
        scale_step = F32(1.0) / iscale_step
        mse = F32(0.0)
        for i in range(n):
            diff = x[i] - scale_step * F32(min(nmax, nearest_int(iscale_step * x[i])))
            mse += weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_step
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = np.uint8(l & 0xFF)
        sumlx += weights[i] * x[i] * F32(l)
        suml2 += weights[i] * F32(l) * F32(l)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = weights[i]
            li = np.int32(L[i])
            slx = sumlx - w * x[i] * F32(li)
            sl2 = suml2 - w * F32(li) * F32(li)
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != li:
                    slx += w * x[i] * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = np.uint8(new_l & 0xFF)
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True)
def split_signs(xb, weight, xval, signs, parity):
    """|xb| into xval, and into signs[k] the sign bits of weights 8k ... 8k + 7 (a bit set where
    negative). With parity, a group of 8 with an odd count of negatives keeps the sign of its least
    important weight (least weight * x^2) instead, negating that xval: IQ2_XXS, IQ2_XS and IQ3_XXS
    store 7 sign bits, the eighth implied by even parity."""
    for k in range(signs.shape[0]):
        flips = 0
        s = 0
        for i in range(8):
            v = xb[8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                flips += 1
                s |= 1 << i
        if parity and flips % 2:
            imin = 0
            vmin = weight[8 * k] * xb[8 * k] * xb[8 * k]
            for i in range(1, 8):
                a = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                if a < vmin:
                    vmin = a
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127 if parity else s
