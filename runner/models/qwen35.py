"""Qwen3.5 (text): three layers in four are a gated DeltaNet, the fourth gated attention.

A DeltaNet layer projects the residual stream to Q, K and V together (through a causal depthwise
convolution of kernel K with its state, then SiLU), to z (the output gate), and to a and b per
value head. Q and K are L2-normed per head (Q also scaled by 1/sqrt(d_k)); each value head keeps
a (d_k, d_v) state that decays by exp(g), g = A * softplus(a + dt_bias) (the file holds A, that
is -exp(A_log)), and learns v at rate beta = sigmoid(b) by the delta rule. Its output is RMS-normed
per head, times silu(z), and projected back. Value head h reads key head h % key heads (the
converter orders the value heads so). The attention layers gate each head's output by
sigmoid(gate), its projection beside the query's, with per-head Q/K norms and RoPE on part of each
head; their multimodal RoPE rotates text as plain NeoX RoPE does. The feed-forward's norm is the
file's post_attention_norm.

Qwen3-Next is the same model in another layout: its value heads lie grouped by key head (value head
h reads key head h // (value heads / key heads)), and b and a come from one projection, per key
head its value heads' b, then their a.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import MODEL_TENSOR as T

from runner.engine.recurrent_state import CONV, DELTA

from .decoder import Decoder


@dataclass
class GatedDeltaNet:
    qkv: object       # n_embd -> 2 key heads' width + the value heads' width
    z: object         # n_embd -> the value heads' width (the output gate)
    beta_alpha: tuple  # n_embd -> value heads, b's and a's: two matrices, or one with both (Qwen3-Next)
    kernel: object    # (the convolved width, K)
    dt_bias: object   # (value heads,)
    a: object         # (value heads,): -exp(A_log)
    norm: object      # (d_v,)
    out: object       # the value heads' width -> n_embd


class Qwen35(Decoder):
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    ffn_norm_tensor = T.ATTN_POST_NORM
    output_gate = True
    value_heads_grouped = False  # value head h reads key head h // (value heads / key heads), not h % key heads

    def load_recurrent(self, weights, i: int) -> GatedDeltaNet:
        p = self.params
        n, heads = p.n_embd, p.ssm_heads
        width = p.ssm_conv_width
        if weights.has(T.SSM_BETA_ALPHA, i):
            beta_alpha = (weights.matrix(T.SSM_BETA_ALPHA, n, 2 * heads, i),)
        else:
            beta_alpha = (weights.matrix(T.SSM_BETA, n, heads, i), weights.matrix(T.SSM_ALPHA, n, heads, i))
        return GatedDeltaNet(weights.matrix(T.ATTN_QKV, n, width, i), weights.matrix(T.ATTN_GATE, n, p.ssm_inner, i),
                             beta_alpha,
                             weights.small_table(T.SSM_CONV1D, p.ssm_conv_kernel, width, i),
                             weights.vector(T.SSM_DT, heads, i, "bias"), weights.vector(T.SSM_A, heads, i, suffix=None),
                             weights.vector(T.SSM_NORM, p.ssm_inner // heads, i),
                             weights.matrix(T.SSM_OUT, p.ssm_inner, n, i))

    @staticmethod
    def state_shapes(p) -> dict:
        return {CONV: (p.ssm_conv_kernel - 1, p.ssm_conv_width), DELTA: (p.ssm_heads, p.ssm_state, p.ssm_inner // p.ssm_heads)}

    def recurrent(self, d: GatedDeltaNet, h, cache, i: int):
        be, p = self.backend, self.params
        n, d_k, d_v = h.shape[0], p.ssm_state, p.ssm_inner // p.ssm_heads
        key_width = p.ssm_groups * d_k
        qkv, z, *beta_alpha = be.matmuls([d.qkv, d.z, *d.beta_alpha], h)
        if len(beta_alpha) == 1:  # (per key head, its value heads' b, then their a)
            per_key = p.ssm_heads // p.ssm_groups
            beta_alpha = [x.reshape(n, p.ssm_heads) for x in
                          be.split(beta_alpha[0].reshape(n * p.ssm_groups, 2 * per_key), [per_key, per_key])]
        b, a = beta_alpha
        decay = be.unary(a + d.dt_bias, "softplus") * d.a
        beta = be.unary(b, "sigmoid")

        def sequence(rows, seq):
            conv = be.short_conv(qkv[rows], d.kernel, seq.recurrent.conv_history(i, qkv[rows]))
            q, k, v = be.split(be.unary(conv, "silu"), [key_width, key_width, p.ssm_inner])
            # (L2 norms as RMS norms: x / sqrt(sum x^2 + eps) = rms_norm(x, eps / d) / sqrt(d); the
            # queries' further 1/sqrt(d_k) folded in)
            ones = self.ones(d_k)
            q = be.rms_norm(q.reshape(-1, d_k), ones, p.rms_eps / d_k) * np.float32(1 / d_k)
            k = be.rms_norm(k.reshape(-1, d_k), ones, p.rms_eps / d_k) * np.float32(1 / np.sqrt(d_k))
            m = q.shape[0] // p.ssm_groups
            q, k, v = q.reshape(m, p.ssm_groups, d_k), k.reshape(m, p.ssm_groups, d_k), v.reshape(m, p.ssm_heads, d_v)
            grouped = self.value_heads_grouped
            state = seq.recurrent.delta_state(i, q, k, v, decay[rows], beta[rows], grouped=grouped)
            return be.delta_rule(q, k, v, decay[rows], beta[rows], state, grouped).reshape(m, p.ssm_inner)
        out = self.each_sequence(cache, n, sequence)
        out = be.rms_norm(out.reshape(-1, d_v), d.norm, p.rms_eps)
        return be.matmul(d.out, be.silu_mul(z.reshape(-1, d_v), out).reshape(n, p.ssm_inner))


class Qwen3Next(Qwen35):
    value_heads_grouped = True
