"""The non-matrix operations of a decoder layer: norms, rotary embedding, activations.

Activations are float32 arrays of shape (tokens, features). Attention is in attention.py, KV
writes in kv_layout.py.
"""
import math

import numpy as np
from numba import njit

from .intrinsics import exp_f32


# error_model="numpy": a division by zero gives inf instead of Numba's Python-style exception, whose
# check per division keeps loops from vectorizing.
@njit(cache=True, fastmath=True, error_model="numpy")
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


def rope_frequencies(n_rot, base, freq_factors):
    """The n_rot / 2 rotation frequencies (float64); `freq_factors` (None, or n_rot / 2 values)
    divides them, as Llama 3's rope_freqs tensor does."""
    inv_freq = float(base) ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    return inv_freq if freq_factors is None else inv_freq / freq_factors


@njit(cache=True)
def rope_angles(positions, inv_freq, pos_scale, magnitude, cos, sin):
    """cos and sin (tokens, n_rot / 2) float32 of each position's rotation angles, computed in
    float64, times magnitude (LongRoPE's and YaRN's scaling of the rotated dimensions)."""
    for t in range(positions.shape[0]):
        p = np.float64(positions[t]) / pos_scale
        for i in range(inv_freq.shape[0]):
            theta = p * inv_freq[i]
            cos[t, i] = np.float32(magnitude * math.cos(theta))
            sin[t, i] = np.float32(magnitude * math.sin(theta))


def rope_table(positions, inv_freq, pos_scale, magnitude=1.0):
    """cos and sin, (tokens, n_rot / 2) float32, of the positions' rotation angles at the
    frequencies inv_freq (rope_frequencies), times magnitude."""
    cos, sin = (np.empty((len(positions), len(inv_freq)), dtype=np.float32) for _ in range(2))
    rope_angles(positions, inv_freq, np.float64(pos_scale), np.float64(magnitude), cos, sin)
    return cos, sin


@njit(cache=True, fastmath=True)
def rope(x, cos, sin, neox):
    """Rotate the first 2 * cos.shape[1] dimensions of every head of x (tokens, heads, head dim)
    in place. Normal pairing rotates (2i, 2i+1); NeoX pairing rotates (i, i + n_rot/2)."""
    half = cos.shape[1]
    for t in range(x.shape[0]):
        for i in range(half):
            c = cos[t, i]
            s = sin[t, i]
            a = i if neox else 2 * i
            b = i + half if neox else 2 * i + 1
            for h in range(x.shape[1]):
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                x[t, h, a] = x0 * c - x1 * s
                x[t, h, b] = x0 * s + x1 * c


# Both gates are x * sigmoid(k * f(x)), computed with the vectorized exp of intrinsics.py (Numba's
# math.exp and math.tanh call libm one element at a time): SiLU is x * sigmoid(x), and GELU's tanh
# form 0.5 x (1 + tanh(u)) equals x * sigmoid(2u).
_GELU_2C = np.float32(2.0 * math.sqrt(2.0 / math.pi))


@njit(cache=True, fastmath=True, error_model="numpy")
def gelu_mul(gate, up):
    """GeGLU with the tanh approximation of GELU: gelu(gate) * up, written into gate."""
    for t in range(gate.shape[0]):
        g, u = gate[t], up[t]
        for i in range(g.shape[0]):
            x = g[i]
            g[i] = x / (np.float32(1.0) + exp_f32(-_GELU_2C * (x + np.float32(0.044715) * x * x * x))) * u[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate, up):
    """SwiGLU: silu(gate) * up, written into gate."""
    for t in range(gate.shape[0]):
        g, u = gate[t], up[t]
        for i in range(g.shape[0]):
            x = g[i]
            g[i] = x / (np.float32(1.0) + exp_f32(-x)) * u[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def softcap(x, cap, out):
    """out = cap * tanh(x / cap), x and out 1-d."""
    for i in range(x.shape[0]):
        out[i] = cap * math.tanh(x[i] / cap)


@njit(cache=True, fastmath=True, error_model="numpy")
def clamped_swiglu(gate, up, alpha, limit):
    """gpt-oss's SwiGLU, as ggml's swiglu_oai: g * sigmoid(alpha * g) * (u + 1), with g = gate
    clamped above at limit and u = up clamped to [-limit, limit]; written into gate."""
    for t in range(gate.shape[0]):
        g, u = gate[t], up[t]
        for i in range(g.shape[0]):
            x = min(g[i], limit)
            y = min(max(u[i], -limit), limit)
            g[i] = x / (np.float32(1.0) + exp_f32(-alpha * x)) * (y + np.float32(1.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def short_conv(x, kernel, state, out):
    """A causal depthwise convolution over time with its history: out[t, c] = sum over j of
    kernel[c, j] * (state then x)[t + j, c], x and out (tokens, channels), kernel (channels, K),
    state (K - 1, channels) the inputs before x, left as the last K - 1 inputs after it."""
    n, taps = x.shape[0], kernel.shape[1]
    history = state.shape[0]
    for t in range(n):
        for c in range(x.shape[1]):
            acc = np.float32(0.0)
            for j in range(taps):
                at = t + j - history  # (negative: a row of the state)
                acc += kernel[c, j] * (state[history + at, c] if at < 0 else x[at, c])
            out[t, c] = acc
    if n >= history:
        state[:, :] = x[n - history:, :]
    else:  # (fewer new rows than the history holds: it shifts)
        for r in range(history - n):
            state[r, :] = state[r + n, :]
        state[history - n:, :] = x


SILU, SIGMOID, SOFTPLUS, RELU_SQR = 0, 1, 2, 3  # unary's kinds
UNARY = {"silu": SILU, "sigmoid": SIGMOID, "softplus": SOFTPLUS, "relu_sqr": RELU_SQR}


@njit(cache=True, fastmath=True, error_model="numpy")
def unary(x, kind, out):
    """out = silu(x), sigmoid(x), softplus(x) (ggml's: x itself above 20) or relu(x)^2, x and out 1-d."""
    one = np.float32(1.0)
    for i in range(x.shape[0]):
        v = x[i]
        if kind == SILU:
            out[i] = v / (one + exp_f32(-v))
        elif kind == SIGMOID:
            out[i] = one / (one + exp_f32(-v))
        elif kind == RELU_SQR:
            out[i] = v * v if v > np.float32(0.0) else np.float32(0.0)
        else:
            out[i] = v if v > np.float32(20.0) else np.float32(math.log(one + math.exp(v)))


@njit(cache=True, fastmath=True, error_model="numpy")
def delta_rule(q, k, v, decay, beta, grouped, state, out):
    """The gated delta rule, token after token: for each value head h (over key head h % key
    heads, or h // (value heads / key heads) where grouped), S = exp(decay[t, h]) S;
    S += k (beta[t, h] (v - S^T k))^T; out[t, h] = S^T q; with q, k (tokens, key heads, d_k), v and
    out (tokens, value heads, d_v), state S (value heads, d_k, d_v) carried in place."""
    n_k, d_k, d_v = q.shape[1], q.shape[2], v.shape[2]
    per_key = v.shape[1] // n_k
    recalled = np.empty(d_v, dtype=np.float32)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            g = h // per_key if grouped else h % n_k
            s, kh, qh = state[h], k[t, g], q[t, g]
            rate = np.float32(math.exp(decay[t, h]))
            recalled[:] = 0
            for i in range(d_k):
                for j in range(d_v):
                    s[i, j] *= rate
                    recalled[j] += s[i, j] * kh[i]
            for j in range(d_v):
                recalled[j] = (v[t, h, j] - recalled[j]) * beta[t, h]
            out[t, h, :] = 0
            for i in range(d_k):
                for j in range(d_v):
                    s[i, j] += kh[i] * recalled[j]
                    out[t, h, j] += s[i, j] * qh[i]


def check_ssm_shapes(x, dt, b, c, a, d, state) -> None:
    """ValueError unless ssm_scan's operands fit each other (its loops read them unchecked)."""
    n, heads, head_dim = x.shape
    groups, d_state = b.shape[1:]
    arrays = (x, dt, b, c, a, d, state)
    if (dt.shape != (n, heads) or b.shape != (n, groups, d_state) or c.shape != b.shape or a.shape != (heads,)
            or d.shape != (heads,) or state.shape != (heads, head_dim, d_state) or groups == 0 or heads % groups
            or any(v.dtype != np.float32 for v in arrays) or not state.flags.c_contiguous):
        raise ValueError("ssm_scan's operands do not fit: " + ", ".join(str(v.shape) for v in arrays))


@njit(cache=True, fastmath=True, error_model="numpy")
def ssm_scan(x, dt, b, c, a, d, state, out):
    """Mamba2's selective scan, token after token: for each head h (of group g = h // (heads /
    groups)), S = exp(dt[t, h] a[h]) S + (x[t, h] dt[t, h]) B[t, g]^T; out[t, h] = S C[t, g] +
    d[h] x[t, h]; with x and out (tokens, heads, head_dim), dt (tokens, heads) after its
    softplus, B and C (tokens, groups, d_state), a and d (heads,), the state S (heads, head_dim,
    d_state) carried in place."""
    n_head, head_dim, d_state = state.shape
    per_group = n_head // b.shape[1]
    for t in range(x.shape[0]):
        for h in range(n_head):
            g, step = h // per_group, dt[t, h]
            decay = np.float32(math.exp(step * a[h]))
            s, bg, cg = state[h], b[t, g], c[t, g]
            for i in range(head_dim):
                x_dt = x[t, h, i] * step
                acc = np.float32(0.0)
                for j in range(d_state):
                    v = s[i, j] * decay + bg[j] * x_dt
                    s[i, j] = v
                    acc += v * cg[j]
                out[t, h, i] = acc + x[t, h, i] * d[h]
