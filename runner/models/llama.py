"""The Llama family (Llama 2/3, Mistral, Mixtral, TinyLlama, SmolLM2, ERNIE 4.5, Granite): the
shared decoder's pre-norm block as it is, RoPE in the interleaved pairing (the converter permutes
Q/K rows for it), GQA, SwiGLU. Granite's multipliers come from its file and apply to any model."""
from __future__ import annotations

from .decoder import Decoder


class Llama(Decoder):
    rope_neox = False
