"""The Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm blocks, RoPE, GQA, SwiGLU."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from .decoder import Attention, Decoder, FeedForward


@dataclass
class LlamaLayer:
    attn_norm: object
    attn: Attention
    ffn_norm: object
    ffn: FeedForward


class Llama(Decoder):
    rope_neox = False  # GGUF stores Llama's Q/K rows permuted for the interleaved pairing

    def load_layer(self, weights, i):
        n = self.params.n_embd
        return LlamaLayer(attn_norm=weights.vector(T.ATTN_NORM, n, i), attn=self.load_attention(weights, i),
                          ffn_norm=weights.vector(T.FFN_NORM, n, i), ffn=self.load_feed_forward(weights, i))

    def block(self, layer, x, batch, cache, i):
        be, eps = self.backend, self.params.rms_eps
        x = x + self.attention(layer.attn, be.rms_norm(x, layer.attn_norm, eps), batch, cache, i)
        return x + self.feed_forward(layer.ffn, be.rms_norm(x, layer.ffn_norm, eps))
