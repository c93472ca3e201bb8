"""Falcon-H1: each layer runs attention (NeoX RoPE) and a Mamba2 mixer (runner/models/mamba2.py) side
by side on the same RMS-normed input, adds both to the residual stream, then a SwiGLU MLP after its
own norm. Every layer keeps a KV cache and a recurrent state. Falcon-H1's multipliers are in the
weights (llama.cpp's converter folds them in): the graph has none."""
from __future__ import annotations

from gguf import MODEL_TENSOR as T

from .decoder import Decoder, Layer
from .mamba2 import Mamba2Layers


class FalconH1(Mamba2Layers, Decoder):
    rope_neox = True

    def load_layer(self, weights, i: int) -> Layer:
        n = self.params.n_embd
        # (the MLP's norm is named without a suffix, blk.N.ffn_norm, as llama.cpp writes and reads it)
        return Layer(self.load_attention(weights, i), self.load_feed_forward(weights, i),
                     attn_norm=weights.vector(T.ATTN_NORM, n, i), ffn_norm=weights.vector(T.FFN_PRE_NORM, n, i, None),
                     mixer=self.load_recurrent(weights, i))

    def block(self, layer: Layer, x, batch, cache, i: int):
        h = self.norm(x, layer.attn_norm)
        x = x + (self.attention(layer.attn, h, batch, cache, i) + self.recurrent(layer.mixer, h, cache, i))
        return x + self.feed_forward_branch(layer, x)
