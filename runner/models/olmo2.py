"""OLMo 2: norms after attention and after the MLP, none before them (each branch is normalized
before it joins the residual stream), RMSNorm over the whole query and key projections, NeoX
rotary pairing."""
from __future__ import annotations

from .decoder import Decoder


class OLMo2(Decoder):
    pre_norms = False
    post_norms = True
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    qk_norm_per_head = False
