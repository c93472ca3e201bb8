"""OLMo 2: norms after attention and after the MLP, none before them (the branch is normalized
before it joins the residual stream), RMSNorm over the whole query and key projections, NeoX
rotary pairing."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from .decoder import Attention, Decoder, FeedForward


@dataclass
class OLMo2Layer:
    attn: Attention
    post_attn_norm: object
    ffn: FeedForward
    post_ffn_norm: object


class OLMo2(Decoder):
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    qk_norm_per_head = False

    def load_layer(self, weights, i):
        n = self.params.n_embd
        return OLMo2Layer(attn=self.load_attention(weights, i), post_attn_norm=weights.vector(T.ATTN_POST_NORM, n, i),
                          ffn=self.load_feed_forward(weights, i), post_ffn_norm=weights.vector(T.FFN_POST_NORM, n, i))

    def block(self, layer, x, batch, cache, i):
        be, eps = self.backend, self.params.rms_eps
        x = x + be.rms_norm(self.attention(layer.attn, x, batch, cache, i), layer.post_attn_norm, eps)
        return x + be.rms_norm(self.feed_forward(layer.ffn, x), layer.post_ffn_norm, eps)
