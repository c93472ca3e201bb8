"""Gemma 3: Gemma 2's block with per-head Q/K norms, five sliding layers to each global one with
a RoPE base of their own (both declared in gguf_io.architectures)."""
from __future__ import annotations

from .gemma2 import Gemma2


class Gemma3(Gemma2):
    extra_attention_tensors = ("q_norm", "k_norm")
