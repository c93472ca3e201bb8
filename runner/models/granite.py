"""Granite and Granite-MoE (IBM): the Llama block with multipliers from the file. The shared
decoder applies the embedding, attention and logit ones; the residual one scales each branch of
the block before it joins the residual stream, here. Granite-MoE's experts (and its shared
expert, where it has one) fill the decoder's feed-forward slot."""
from __future__ import annotations

import numpy as np

from .llama import Llama


class Granite(Llama):
    def block(self, layer, x, batch, cache, i):
        be, p = self.backend, self.params
        scale = np.float32(p.residual_scale or 1.0)
        x = x + self.attention(layer.attn, be.rms_norm(x, layer.attn_norm, p.rms_eps), batch, cache, i) * scale
        return x + self.feed_forward(layer.ffn, be.rms_norm(x, layer.ffn_norm, p.rms_eps)) * scale
