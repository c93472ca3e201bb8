"""Qwen 2 and Qwen 3: the Llama block with NeoX rotary pairing and their own attention extras."""
from .llama import Llama


class Qwen2(Llama):
    """Llama with biases on the Q/K/V projections and NeoX rotary pairing."""
    rope_neox = True
    extra_attention_tensors = ("bq", "bk", "bv")


class Qwen3(Llama):
    """Llama with per-head RMSNorm on queries and keys and NeoX rotary pairing."""
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
