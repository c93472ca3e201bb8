"""Seed-OSS (ByteDance): the Llama block with biases on Q/K/V and NeoX rotary pairing; gguf names
its pre-MLP norm attn_post_norm (the checkpoint's post_attention_layernorm)."""
from __future__ import annotations

from gguf import MODEL_TENSOR as T

from .decoder import Decoder


class SeedOSS(Decoder):
    ffn_norm_tensor = T.ATTN_POST_NORM
    rope_neox = True
