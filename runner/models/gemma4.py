"""Gemma 4 (text): Gemma 3's block with a head size, KV head count and rotation of its own on the
global layers (their proportional RoPE as frequency divisors from the file, rope_freqs), values
RMS-normed without weight and taken from the keys' projection where a layer has no V, scores
unscaled, and three additions: the last layers attend over the cache of the last earlier layer
of their kind (shared KV), a per-layer token embedding joins each block's output through a gated
projection, and each block's output is scaled by a factor of its own. In its mixture of experts
(26B-A4B) a layer's dense MLP and its experts run side by side, each normed on both sides, the
router reading the normed residual stream."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import MODEL_TENSOR as T

from gguf_io import GGUFError

from .decoder import FeedForward, MixtureOfExperts
from .gemma2 import Gemma2


@dataclass
class DenseAndExperts:
    """A mixture layer's feed-forward: ffn_post_norm_1(dense(ffn_norm x)) +
    ffn_post_norm_2(experts(pre_ffw_norm_2 x)), the experts chosen by router_norm x."""
    dense: FeedForward
    experts: MixtureOfExperts
    router_norm: object        # the router's scale over sqrt(n_embd), as an RMSNorm weight
    experts_norm: object
    dense_post_norm: object
    experts_post_norm: object


@dataclass
class PerLayerInput:
    """A block's share of the per-layer embeddings: x + norm(proj(gelu(gate x) * input))."""
    gate: object   # n_embd -> n_embd_per_layer
    proj: object   # n_embd_per_layer -> n_embd
    norm: object


class Gemma4(Gemma2):
    extra_attention_tensors = ("q_norm", "k_norm")
    value_norm = True
    values_from_keys = True
    query_scale = 1.0

    def __init__(self, params, weights, backend):
        p = params
        for i in range(p.n_layer_kv, p.n_layer) if p.n_layer_kv else ():
            # (llama.cpp reuses the cache of layer n_layer_kv - 2 for sliding layers, n_layer_kv - 1 for global)
            if p.kv_source(i) != p.n_layer_kv - (2 if p.layer_windows[i] else 1):
                raise GGUFError(f"layer {i} shares the cache of layer {p.kv_source(i)}, not the one llama.cpp's "
                                f"Gemma 4 graph reads")
        super().__init__(params, weights, backend)
        self.out_scales = [weights.optional_scalar(T.LAYER_OUT_SCALE, i) for i in range(p.n_layer)]
        n_pl = p.n_embd_per_layer
        if n_pl:
            self.per_layer_token_embd = weights.table(T.PER_LAYER_TOKEN_EMBD, n_pl * p.n_layer, p.vocab_size)
            self.per_layer_model_proj = weights.matrix(T.PER_LAYER_MODEL_PROJ, p.n_embd, n_pl * p.n_layer)
            self.per_layer_proj_norm = weights.vector(T.PER_LAYER_PROJ_NORM, n_pl)
            self.per_layer = [PerLayerInput(weights.matrix(T.PER_LAYER_INP_GATE, p.n_embd, n_pl, i),
                                            weights.matrix(T.PER_LAYER_PROJ, n_pl, p.n_embd, i),
                                            weights.vector(T.PER_LAYER_POST_NORM, p.n_embd, i))
                              for i in range(p.n_layer)]

    def load_feed_forward(self, weights, i: int):
        p = self.params
        if not (p.n_expert and weights.has(T.FFN_GATE_INP, i)):
            return self.load_dense(weights, i)
        n = p.n_embd
        return DenseAndExperts(self.load_dense(weights, i), self.load_experts(weights, i),
                               weights.vector(T.FFN_GATE_INP, n, i, "scale", times=1 / math.sqrt(n)),
                               *(weights.vector(t, n, i) for t in (T.FFN_PRE_NORM_2, T.FFN_POST_NORM_1,
                                                                     T.FFN_POST_NORM_2)))

    def feed_forward_branch(self, layer, x):
        ffn = layer.ffn
        if not isinstance(ffn, DenseAndExperts):
            return super().feed_forward_branch(layer, x)
        dense = self.norm(self.feed_forward(ffn.dense, self.norm(x, layer.ffn_norm)), ffn.dense_post_norm)
        experts = self.mixture_of_experts(ffn.experts, self.norm(x, ffn.experts_norm),
                                          router_input=self.norm(x, ffn.router_norm))
        return dense + self.norm(experts, ffn.experts_post_norm)

    def layer_rope_factors(self, i: int) -> tuple:
        # (rope_freqs is the global layers' proportional RoPE: the sliding layers rotate plainly)
        return (None, None) if self.params.layer_windows[i] else self.rope_factors

    def blocks(self, x, batch, cache):
        inputs = self.per_layer_inputs(x, batch) if self.params.n_embd_per_layer else None
        for i, layer in enumerate(self.layers):
            x = self.block(layer, x, batch, cache, i)
            if inputs is not None:
                x = x + self.per_layer_branch(self.per_layer[i], x, inputs[i])
            if self.out_scales[i] is not None:
                x = x * np.float32(self.out_scales[i])
        return x

    def per_layer_inputs(self, x, batch) -> list:
        """Each layer's input (T, n_embd_per_layer): its slice of the token's per-layer embedding
        plus the normed projection of the scaled token embedding x, over sqrt 2."""
        be, p = self.backend, self.params
        n_pl, n = p.n_embd_per_layer, x.shape[0]
        tokens = be.embed(self.per_layer_token_embd, batch.ids) * np.float32(math.sqrt(n_pl))
        projected = be.matmul(self.per_layer_model_proj, x) * np.float32(1 / math.sqrt(p.n_embd))
        projected = be.rms_norm(projected.reshape(-1, n_pl), self.per_layer_proj_norm, p.rms_eps).reshape(n, -1)
        inputs = (projected + tokens) * np.float32(1 / math.sqrt(2))
        return be.split(inputs, [n_pl] * p.n_layer)

    def per_layer_branch(self, w: PerLayerInput, x, layer_input):
        be = self.backend
        return self.norm(be.matmul(w.proj, be.gelu_mul(be.matmul(w.gate, x), layer_input)), w.norm)
