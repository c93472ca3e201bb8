"""Gemma 2: scaled embeddings, norms before and after attention and MLP, GELU-gated MLP, sliding
window layers alternating with global ones (the pattern declared in gguf_io.architectures), and
softcapped attention scores and logits (the caps from the file, applied by the shared decoder)."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from .decoder import Attention, Decoder, FeedForward


@dataclass
class GemmaLayer:
    attn_norm: object
    attn: Attention
    post_attn_norm: object
    ffn_norm: object
    ffn: FeedForward
    post_ffn_norm: object


class Gemma2(Decoder):
    rope_neox = True
    embed_scale = True
    gated_activation = "gelu"

    def load_layer(self, weights, i):
        n = self.params.n_embd
        return GemmaLayer(
            attn_norm=weights.vector(T.ATTN_NORM, n, i), attn=self.load_attention(weights, i),
            post_attn_norm=weights.vector(T.ATTN_POST_NORM, n, i), ffn_norm=weights.vector(T.FFN_PRE_NORM, n, i),
            ffn=self.load_feed_forward(weights, i), post_ffn_norm=weights.vector(T.FFN_POST_NORM, n, i))

    def block(self, layer, x, batch, cache, i):
        be, eps = self.backend, self.params.rms_eps
        a = self.attention(layer.attn, be.rms_norm(x, layer.attn_norm, eps), batch, cache, i)
        x = x + be.rms_norm(a, layer.post_attn_norm, eps)
        f = self.feed_forward(layer.ffn, be.rms_norm(x, layer.ffn_norm, eps))
        return x + be.rms_norm(f, layer.post_ffn_norm, eps)
