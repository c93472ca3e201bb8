"""The non-matrix operations of a decoder layer: norms, rotary embedding, KV writes, activations.

Activations are float32 arrays of shape (tokens, features). Attention is in attention.py.
"""
import math

import numpy as np
from numba import njit, prange

from .intrinsics import from_f32


@njit(cache=True, fastmath=True)
def rms_norm(x, weight, eps, out):
    """out = x / rms(x) * weight over the last axis; x is (rows, d)."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(d):
            ss += x[t, i] * x[t, i]
        inv = np.float32(1.0 / math.sqrt(ss / d + eps))
        for i in range(d):
            out[t, i] = x[t, i] * inv * weight[i]


@njit(cache=True, fastmath=True)
def rope(x, positions, n_rot, base, pos_scale, neox, freq_factors):
    """Rotate the first n_rot dimensions of every head of x (tokens, heads, head dim) in place.

    Normal pairing rotates (2i, 2i+1); NeoX pairing rotates (i, i + n_rot/2). `freq_factors`
    (empty, or n_rot/2 values) divides each frequency, as Llama 3's rope_freqs tensor does.
    """
    half = n_rot // 2
    for t in range(x.shape[0]):
        p = positions[t] / pos_scale
        for i in range(half):
            theta = p * base ** (-2.0 * i / n_rot)
            if freq_factors.size:
                theta /= freq_factors[i]
            c = np.float32(math.cos(theta))
            s = np.float32(math.sin(theta))
            a = i if neox else 2 * i
            b = i + half if neox else 2 * i + 1
            for h in range(x.shape[1]):
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                x[t, h, a] = x0 * c - x1 * s
                x[t, h, b] = x0 * s + x1 * c


@njit(cache=True)
def store_kv(keys, values, slots, k, v):
    """Write token t's k[t] (kv heads, dim) into column slots[t] of keys (kv heads, dim, slots)
    and its v[t] into row slots[t] of values (kv heads, slots, dim); caches hold float32 or
    float16 bits (uint16)."""
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(keys.shape[0]):
            for i in range(keys.shape[1]):
                keys[h, i, s] = from_f32(k[t, h, i], keys)
            for i in range(values.shape[2]):
                values[h, s, i] = from_f32(v[t, h, i], values)


# Activations use numpy's ufuncs: their exp and tanh are SIMD, where Numba's call libm per element.
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu_mul(gate, up):
    """GeGLU with the tanh approximation of GELU: gelu(gate) * up, written into gate."""
    inner = gate * gate
    inner *= np.float32(0.044715)
    inner += np.float32(1.0)
    inner *= gate
    inner *= _GELU_C
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    inner *= np.float32(0.5)
    gate *= inner
    gate *= up


def silu_mul(gate, up):
    """SwiGLU: silu(gate) * up = gate / (1 + exp(-gate)) * up, written into gate."""
    denominator = np.negative(gate)
    np.exp(denominator, out=denominator)
    denominator += np.float32(1.0)
    gate /= denominator
    gate *= up
