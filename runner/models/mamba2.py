"""Mamba2 layers, as hybrids have them among attention layers (Granite 4.0-H, Nemotron-H) or beside
them (Falcon-H1), and plain Mamba2 alone.

in_proj projects the residual stream to z (the output gate, d_inner wide), xBC (x, then B and C of
n_group groups of d_state) and dt (one per head). xBC goes through a causal depthwise convolution
of kernel K (with the last K - 1 inputs as its state) plus its bias, then SiLU. Each head h (of
head_dim channels of x, reading group h // (heads / groups) of B and C) keeps a (head_dim,
d_state) state that decays by exp(dt A[h]), dt = softplus(dt + dt_bias) (the file holds A, that is
-exp(A_log)), and takes in x dt B; its output is the state times C, plus D[h] x. That output,
times silu(z), is RMS-normed in n_group groups (each with its own weights; where the file has
them: Falcon-H1's mixers may have no norm, as llama.cpp's graph reads them) and projected back.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from runner.engine.recurrent_state import CONV, SSM


@dataclass
class Mamba2:
    in_proj: object    # n_embd -> z, xBC and dt
    kernel: object     # (xBC's width, K)
    conv_bias: object  # (xBC's width,), or None
    dt_bias: object    # (heads,)
    a: object          # (heads,): -exp(A_log)
    d: object          # (heads,)
    norm: object       # (d_inner,): each group's weights, or None: no norm
    out: object        # d_inner -> n_embd


class Mamba2Layers:
    """A decoder's recurrent layers as Mamba2 (mixed in before Decoder)."""

    def load_recurrent(self, weights, i: int) -> Mamba2:
        p = self.params
        heads, inner = p.ssm_heads, p.ssm_inner
        width = p.ssm_conv_width
        return Mamba2(weights.matrix(T.SSM_IN, p.n_embd, inner + width + heads, i),
                      weights.small_table(T.SSM_CONV1D, p.ssm_conv_kernel, width, i),
                      weights.optional_vector(T.SSM_CONV1D, width, i, "bias"),
                      weights.vector(T.SSM_DT, heads, i, "bias"),
                      *(weights.flat(t, (1, heads), i, suffix=None) for t in (T.SSM_A, T.SSM_D)),
                      weights.flat(T.SSM_NORM, (inner // p.ssm_groups, p.ssm_groups), i)
                      if weights.has(T.SSM_NORM, i) else None,
                      weights.matrix(T.SSM_OUT, inner, p.n_embd, i))

    @staticmethod
    def state_shapes(p) -> dict:
        return {CONV: (p.ssm_conv_kernel - 1, p.ssm_conv_width), SSM: (p.ssm_heads, p.ssm_inner // p.ssm_heads, p.ssm_state)}

    def recurrent(self, m: Mamba2, h, cache, i: int):
        be, p = self.backend, self.params
        heads, groups, d_state, inner = p.ssm_heads, p.ssm_groups, p.ssm_state, p.ssm_inner
        group_width = inner // groups
        z, xbc, dt = be.split(be.matmul(m.in_proj, h), [inner, p.ssm_conv_width, heads])
        dt = be.unary(dt + m.dt_bias, "softplus")

        def sequence(rows, seq):
            conv = be.short_conv(xbc[rows], m.kernel, seq.recurrent.conv_history(i, xbc[rows]))
            conv = conv if m.conv_bias is None else conv + m.conv_bias
            x, b, c = be.split(be.unary(conv, "silu"), [inner, groups * d_state, groups * d_state])
            n = x.shape[0]
            x, b, c = x.reshape(n, heads, inner // heads), b.reshape(n, groups, d_state), c.reshape(n, groups, d_state)
            state = seq.recurrent.ssm_state(i, x, dt[rows], b, c, m.a, m.d)
            return be.ssm_scan(x, dt[rows], b, c, m.a, m.d, state).reshape(n, inner)
        y = be.silu_mul(z, self.each_sequence(cache, h.shape[0], sequence))
        # (each group's RMS norm, then the groups' weights, as one row: a scale of 1 changes nothing)
        if m.norm is not None:
            y = be.rms_norm(y.reshape(-1, group_width), self.ones(group_width), p.rms_eps).reshape(-1, inner) * m.norm
        return be.matmul(m.out, y)
