"""Nemotron-H: each layer is one block, RMS-normed before it and added to the residual stream: a
Mamba2 mixer (runner/models/mamba2.py), attention without RoPE, or a feed-forward of up, ReLU^2 and
down (no gate). Which one a layer is, the file says by its KV heads and feed-forward width."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from .decoder import Decoder, Layer
from .mamba2 import Mamba2Layers


@dataclass
class ReluSquaredMLP:
    up: object     # n_embd -> the layer's feed-forward width
    down: object


class NemotronH(Mamba2Layers, Decoder):
    def rotates(self, i: int) -> bool:
        return False

    def load_layer(self, weights, i: int) -> Layer:
        p = self.params
        if p.recurrent(i):
            block = self.load_recurrent(weights, i)
        elif p.attends(i):
            block = self.load_attention(weights, i)
        else:
            n_ff = p.layer_ff(i)
            block = ReluSquaredMLP(weights.matrix(T.FFN_UP, p.n_embd, n_ff, i),
                                   weights.matrix(T.FFN_DOWN, n_ff, p.n_embd, i))
        return Layer(block, None, attn_norm=weights.vector(T.ATTN_NORM, p.n_embd, i))

    def block(self, layer: Layer, x, batch, cache, i: int):
        be, p, h = self.backend, self.params, self.norm(x, layer.attn_norm)
        if p.recurrent(i):
            return x + self.recurrent(layer.attn, h, cache, i)
        if p.attends(i):
            return x + self.attention(layer.attn, h, batch, cache, i)
        mlp = layer.attn
        return x + be.matmul(mlp.down, be.unary(be.matmul(mlp.up, h), "relu_sqr"))
