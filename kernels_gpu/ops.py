"""The non-matrix operations of a decoder layer in torch, with the CPU kernels' conventions.

Activations are (tokens, features) float32 tensors. Nothing here reads a value back to the host,
so a decode step built of these ops can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from .kv_layout import keys_f32, values_f32


def rms_norm(x, weight, eps: float):
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * weight


def rope(x, positions, n_rot: int, base: float, pos_scale: float, neox: bool, freq_factors, magnitude: float = 1.0):
    """Rotate the first n_rot dimensions of every head of x (tokens, heads, dim) in place, scaling
    them by magnitude (LongRoPE's and YaRN's factor); the
    angles are computed in float64 as the CPU table is. NeoX pairs (i, i + n_rot/2), the other
    pairing (2i, 2i + 1). The angles are recomputed on every call rather than cached across
    layers: a cached table would be baked into a recorded CUDA graph and go stale on replay."""
    inv_freq = float(base) ** (-torch.arange(0, n_rot, 2, dtype=torch.float64, device=x.device) / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    theta = positions.to(torch.float64)[:, None] / pos_scale * inv_freq
    cos, sin = ((magnitude * f(theta)).to(torch.float32)[:, None] for f in (torch.cos, torch.sin))
    if neox:
        a, b = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    a0 = a.clone()
    a.copy_(a0 * cos - b * sin)
    b.copy_(a0 * sin + b * cos)


def attention(q, keys, values, q_pos, k_pos, scale: float, window: int, softcap: float, sinks=None):
    """Causal grouped-query attention of q (T, heads, dim) over the first len(k_pos) slots of
    keys (kv heads, dim, slots) and values (kv heads, slots, dim), as kv_layout.py holds them;
    slot s holds position k_pos[s] (-1: empty). A query sees 0 <= k_pos <= its position, and with a sliding window
    only positions less than `window` behind it. Each head's sink logit (sinks (heads,), or None)
    joins its softmax as a slot without a value. Returns (T, heads, value dim)."""
    n_tokens, n_head, dim = q.shape
    n_kv, n = keys.shape[0], k_pos.shape[0]
    group = n_head // n_kv
    # (kv heads, group x tokens, dim): the queries sharing a KV head form one batched product
    qg = q.reshape(n_tokens, n_kv, group, dim).permute(1, 2, 0, 3).reshape(n_kv, group * n_tokens, dim)
    scores = torch.bmm(qg * scale, keys_f32(keys, n))
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    qp, kp = q_pos[:, None].to(torch.int64), k_pos[None, :].to(torch.int64)
    visible = (kp >= 0) & (kp <= qp)
    if window:
        visible &= qp - kp < window
    scores = scores.reshape(n_kv, group, n_tokens, n).masked_fill(~visible, -math.inf)
    if sinks is not None:  # (the sink as one more column, dropped after the softmax)
        sink = sinks.reshape(n_kv, group, 1, 1).expand(n_kv, group, n_tokens, 1)
        scores = torch.cat([scores, sink], dim=-1)
    # a query that sees nothing (never the case in a model) gets zeros rather than NaNs
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :n].reshape(n_kv, group * n_tokens, n)
    out = torch.bmm(probs, values_f32(values, n))
    return out.reshape(n_kv, group, n_tokens, -1).permute(2, 0, 1, 3).reshape(n_tokens, n_head, -1)


def silu_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


def gelu_mul(gate, up):
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's SwiGLU (ggml's swiglu_oai): gate clamped above at limit, up to [-limit, limit]."""
    g = gate.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + 1)


def softcap(x, cap: float):
    return torch.tanh(x / cap) * cap


def short_conv(x, kernel, state):
    """kernels_cpu.ops.short_conv's causal depthwise convolution, its state (K - 1, channels) updated
    in place to the last K - 1 inputs."""
    history = state.shape[0]
    rows = torch.cat([state, x])
    out = torch.nn.functional.conv1d(rows.t()[None], kernel[:, None, :], groups=kernel.shape[0])[0].t()
    state.copy_(rows[rows.shape[0] - history:])
    return out


UNARY = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "relu_sqr": lambda x: torch.relu(x).square(),
         "softplus": lambda x: torch.where(x > 20, x, torch.log1p(torch.exp(x)))}


# tokens a chunk of the chunked scans: their within-chunk products are (chunk x chunk) matrices
CHUNK = 64
# passes of at most this many tokens run the scans token after token (fewer launches than a chunk's)
RECURRENT_MAX = 4


def delta_rule(q, k, v, decay, beta, state, grouped=False):
    """kernels_cpu.ops.delta_rule's gated delta rule, its state updated in place: token after token
    for a short pass, chunk after chunk for a longer one."""
    repeat = v.shape[1] // q.shape[1]
    # (value head h reads key head h // repeat where grouped, else h % key heads)
    spread = partial(torch.repeat_interleave, repeats=repeat, dim=1) if grouped else lambda x: x.repeat(1, repeat, 1)
    q, k = spread(q), spread(k)
    if q.shape[0] > RECURRENT_MAX:
        return _chunked_delta_rule(q, k, v, decay, beta, state)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(torch.exp(decay[t])[:, None, None])
        recalled = torch.einsum("hij,hi->hj", state, k[t])
        delta = (v[t] - recalled) * beta[t][:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hij,hi->hj", state, q[t])
    return out


def _in_chunks(x, size: int):
    """x (tokens, heads, ...) as (chunks, heads, size, ...), the last chunk padded with zeros."""
    n_chunks = -(-x.shape[0] // size)
    pad = n_chunks * size - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return x.reshape(n_chunks, size, *x.shape[1:]).transpose(1, 2).contiguous()


def _from_chunks(x, n: int):
    """_in_chunks' inverse for its first n tokens."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])[:n]


def _decays(log_decay):
    """Of per-token log decays (chunks, heads, size): within[i, j] the decay from after token j to
    token i of a chunk (exp of the sum over j < s <= i, each sum taken on its own terms rather than
    as a difference of running sums; 0 for j > i), the log decay from the chunk's start to each
    token (token included) and from each token to the chunk's end (token excluded)."""
    size = log_decay.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = log_decay[..., :, None].expand(*log_decay.shape, size).masked_fill(~below, 0).cumsum(-2)
    within = sums.masked_fill(below.t(), float("-inf"))
    return within.exp(), log_decay.cumsum(-1), sums[..., -1, :]


def _chunked_delta_rule(q, k, v, decay, beta, state):
    """The gated delta rule over chunks of CHUNK tokens (Gated Delta Networks' chunkwise form), q and
    k spread to the value heads. Within a chunk from state S, with L the within-chunk decays, g the
    decays from its start: token i's correction u_i = beta_i (v_i - g_i S^T k_i - sum over j < i of
    L[i, j] (k_i . k_j) u_j), the unit lower-triangular system (I + A) U = beta V - beta g K S, so
    U = U0 - W S with (W, U0) = (I + A)^-1 (beta g K, beta V); out = P U + g Q S with P = L * Q K^T
    (diagonal included); the state after it g_end S + (K * L[end, :])^T U."""
    n, heads, d_k = q.shape
    size = min(CHUNK, n)
    q, k, v, decay, beta = (_in_chunks(x, size) for x in (q, k, v, decay, beta))
    within, from_start, to_end = _decays(decay)
    a = (k @ k.mT * within * beta[..., None]).tril(-1)
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    inverse = torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True)
    w, u0 = inverse @ (k * (beta * from_start.exp())[..., None]), inverse @ (v * beta[..., None])
    p = q @ k.mT * within
    out = p @ u0
    q_state = q * from_start.exp()[..., None] - p @ w  # (out = P U0 + (g Q - P W) S)
    k_end = (k * to_end.exp()[..., None]).mT
    chunk_decay = from_start[..., -1].exp()[..., None, None]
    s = state
    for i in range(q.shape[0]):
        out[i].baddbmm_(q_state[i], s)
        s = torch.baddbmm(s * chunk_decay[i], k_end[i], torch.baddbmm(u0[i], w[i], s, alpha=-1))
    state.copy_(s)
    return _from_chunks(out, n)


def ssm_scan(x, dt, b, c, a, d, state):
    """kernels_cpu.ops.ssm_scan's Mamba2 scan, its state updated in place: token after token for a
    short pass, chunk after chunk for a longer one."""
    per_group = state.shape[0] // b.shape[1]
    if x.shape[0] > RECURRENT_MAX:
        return _chunked_ssm_scan(x, dt, b, c, a, state) + x * d[:, None]
    b, c = b.repeat_interleave(per_group, 1), c.repeat_interleave(per_group, 1)  # (head h reads group h // per_group)
    decay = torch.exp(dt * a)
    x_dt = x * dt[:, :, None]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state.mul_(decay[t][:, None, None]).add_(x_dt[t][:, :, None] * b[t][:, None, :])
        out[t] = torch.einsum("hij,hj->hi", state, c[t])
    return out + x * d[:, None]


def _chunked_ssm_scan(x, dt, b, c, a, state):
    """The Mamba2 scan but its D term over chunks of CHUNK tokens (Mamba2's SSD form): within a
    chunk from state S, out_i = sum over j <= i of L[i, j] (c_i . b_j) dt_j x_j + g_i S c_i, with L
    the within-chunk decays and g those from its start; the state after it g_end S plus the chunk's
    own (sum over j of L[end, j] dt_j x_j b_j^T), passed on chunk after chunk."""
    n, heads, head_dim = x.shape
    groups, d_state = b.shape[1:]
    size = min(CHUNK, n)
    x_dt, log_decay = _in_chunks(x * dt[:, :, None], size), _in_chunks(dt * a, size)
    b, c = _in_chunks(b, size), _in_chunks(c, size)  # (chunks, groups, size, d_state)
    n_chunks, per_group = x_dt.shape[0], heads // groups
    within, from_start, to_end = _decays(log_decay)
    # (a group's heads as (chunks, groups, heads a group, ...); their states side by side as rows
    # (chunks, groups, heads a group x head_dim, d_state), each group's B and C multiplying them all at once)
    by_group = (n_chunks, groups, per_group, size)
    out = (within.view(*by_group, size) * (c @ b.mT)[:, :, None]).view(within.shape) @ x_dt
    weighted = (x_dt * to_end.exp()[..., None]).view(*by_group, head_dim).transpose(-1, -2)
    own = weighted.reshape(n_chunks, groups, per_group * head_dim, size) @ b
    chunk_decay = from_start[..., -1].exp().view(n_chunks, groups, per_group, 1, 1)
    starts = torch.empty((n_chunks + 1, groups, per_group, head_dim, d_state), dtype=state.dtype, device=state.device)
    starts[0] = state.reshape(starts.shape[1:])
    for i in range(n_chunks):
        torch.addcmul(own[i].view(starts.shape[1:]), starts[i], chunk_decay[i], out=starts[i + 1])
    state.copy_(starts[-1].view(state.shape))
    carried = c @ starts[:-1].view(n_chunks, groups, per_group * head_dim, d_state).mT
    out.view(*by_group, head_dim).add_(
        from_start.exp().view(*by_group, 1) * carried.view(n_chunks, groups, size, per_group, head_dim).transpose(2, 3))
    return _from_chunks(out, n)


# the smallest sum renormalized expert weights divide by (llama.cpp clamps to float16's smallest normal)
MIN_WEIGHT_SUM = 6.103515625e-5


def route(logits, k: int, gating: str, norm: bool, scale: float, selection_bias=None):
    """Each token's k most probable experts (ids, best first; chosen by the probabilities plus
    selection_bias where given) and their weights, as kernels_cpu.experts.route computes them."""
    # (gpt-oss's softmax_weight: picked by the logits, the softmax over the chosen)
    probs = logits if gating == "softmax_weight" else (
        torch.softmax(logits, dim=-1) if gating == "softmax" else torch.sigmoid(logits))
    if selection_bias is None:
        weights, ids = torch.topk(probs, k, dim=-1)
    else:
        ids = torch.topk(probs + selection_bias, k, dim=-1).indices
        weights = probs.gather(-1, ids)
    if gating == "softmax_weight":
        weights = torch.softmax(weights, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return ids, weights * scale


def expert_combine(y, weights):
    """sum over j of weights[t, j] * y[t * k + j], for every token t."""
    n_tokens, k = weights.shape
    return (y.view(n_tokens, k, -1) * weights[:, :, None]).sum(dim=1)


def sigmoid_gate(x, g):
    return x * torch.sigmoid(g)
