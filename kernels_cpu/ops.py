"""The non-matrix operations of a decoder layer: norms, rotary embedding, attention, activations.

Activations are float32 arrays of shape (tokens, features); attention reads a KV cache laid out
as (kv heads, slots, head dim) with a position per slot, so any slot order (including a ring)
works: the mask is computed from positions, not from slot indices.
"""
import math

import numpy as np
from numba import njit, prange


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


@njit(cache=True, parallel=True, fastmath=True)
def attention(q, k_cache, v_cache, q_pos, k_pos, scale, window, softcap, out):
    """Causal grouped-query attention of queries q (T, H, D) over cached keys and values.

    Slot s is visible to query t when 0 <= k_pos[s] <= q_pos[t] and, with a sliding window,
    q_pos[t] - k_pos[s] < window. Empty slots carry position -1.
    """
    n_tokens, n_head, _ = q.shape
    n_kv, n_slots, _ = k_cache.shape
    group = n_head // n_kv
    for th in prange(n_tokens * n_head):
        t = th // n_head
        h = th % n_head
        kv = h // group
        scores = np.empty(n_slots, dtype=np.float32)
        best = -np.inf
        for s in range(n_slots):
            kp = k_pos[s]
            if kp < 0 or kp > q_pos[t] or (window > 0 and q_pos[t] - kp >= window):
                scores[s] = -np.inf
                continue
            dot = np.float32(0.0)
            for i in range(q.shape[2]):
                dot += q[t, h, i] * k_cache[kv, s, i]
            dot *= scale
            if softcap > 0:
                dot = softcap * math.tanh(dot / softcap)
            scores[s] = dot
            best = max(best, dot)
        total = np.float32(0.0)
        for s in range(n_slots):
            e = np.float32(math.exp(scores[s] - best)) if scores[s] > -np.inf else np.float32(0.0)
            scores[s] = e
            total += e
        for i in range(out.shape[2]):
            out[t, h, i] = 0.0
        for s in range(n_slots):
            if scores[s] > 0:
                w = scores[s] / total
                for i in range(out.shape[2]):
                    out[t, h, i] += w * v_cache[kv, s, i]


@njit(cache=True, fastmath=True)
def gelu_mul(gate, up):
    """GeGLU with the tanh approximation of GELU: gelu(gate) * up, written into gate."""
    c = math.sqrt(2.0 / math.pi)
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            gate[t, i] = 0.5 * g * (1.0 + math.tanh(c * (g + 0.044715 * g * g * g))) * up[t, i]


@njit(cache=True, fastmath=True)
def silu_mul(gate, up):
    """SwiGLU: silu(gate) * up, written into gate."""
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            gate[t, i] = g / (1.0 + math.exp(-g)) * up[t, i]
