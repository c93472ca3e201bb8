"""Gemma 2: scaled embeddings, norms before and after attention and MLP, GELU-gated MLP, sliding
window layers alternating with global ones (the pattern declared in gguf_io.architectures), and
softcapped attention scores and logits (the caps from the file, applied by the shared decoder)."""
from __future__ import annotations

from gguf import MODEL_TENSOR as T

from .decoder import Decoder


class Gemma2(Decoder):
    post_norms = True
    ffn_norm_tensor = T.FFN_PRE_NORM
    rope_neox = True
    embed_scale = True
    gated_activation = "gelu"
