"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama block with Q, K and V as one matrix where the
file holds them so, gate and up as one, NeoX rotary pairing over a share of each head, LongRoPE's
frequency tables (the decoder picks short or long by context) and a window on every layer where
the file gives one."""
from __future__ import annotations

from .llama import Llama


class Phi3(Llama):
    rope_neox = True
    fused_gate_up = True
