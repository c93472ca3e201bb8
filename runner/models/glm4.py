"""GLM-4 (0414): norms before and after attention and the MLP, gate and up as one matrix, biases
on Q/K/V, RoPE on half of each head in the interleaved pairing (GLM's own: its checkpoints need
no permutation)."""
from __future__ import annotations

from .decoder import Decoder


class GLM4(Decoder):
    post_norms = True
    fused_gate_up = True
    rope_neox = False
