"""EXAONE 4: norms after attention and the MLP only (as OLMo 2), per-head Q/K norms, NeoX
rotary pairing; where some layers slide (three of four in the 32B), the global layers attend
without RoPE."""
from __future__ import annotations

from .decoder import Decoder


class EXAONE4(Decoder):
    pre_norms = False
    post_norms = True
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    nope_global_layers = True
