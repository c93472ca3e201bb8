"""Nemotron-H: each layer is one block, RMS-normed before it and added to the residual stream: a
Mamba2 mixer (runner/models/mamba2.py), attention without RoPE, or a feed-forward of up, ReLU^2 and
down (no gate). Which one a layer is, the file says by its KV heads and feed-forward width.
Nemotron-H-MoE (Nemotron 3): its feed-forward blocks are mixtures of such experts under a sigmoid
router with a selection bias, beside a shared expert, optionally within latent projections."""
from __future__ import annotations

from gguf import MODEL_TENSOR as T

from .decoder import Decoder, Layer
from .mamba2 import Mamba2Layers


class NemotronH(Mamba2Layers, Decoder):
    ungated_activation = "relu_sqr"

    def rotates(self, i: int) -> bool:
        return False

    def load_layer(self, weights, i: int) -> Layer:
        p = self.params
        norm = weights.vector(T.ATTN_NORM, p.n_embd, i)
        if p.recurrent(i):
            return Layer(self.load_recurrent(weights, i), None, attn_norm=norm)
        if p.attends(i):
            return Layer(self.load_attention(weights, i), None, attn_norm=norm)
        return Layer(None, self.load_feed_forward(weights, i), attn_norm=norm)

    def block(self, layer: Layer, x, batch, cache, i: int):
        p, h = self.params, self.norm(x, layer.attn_norm)
        if p.recurrent(i):
            return x + self.recurrent(layer.attn, h, cache, i)
        if p.attends(i):
            return x + self.attention(layer.attn, h, batch, cache, i)
        return x + self.feed_forward(layer.ffn, h)


class NemotronHMoE(NemotronH):
    """Every mixture layer has its selection bias (exp_probs_b), as llama.cpp's loader requires."""
    expert_selection_bias = True
