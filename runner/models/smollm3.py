"""SmolLM3: the Llama block, with every fourth layer attending without positional encoding
(NoPE; llama.cpp fixes the interval at 4)."""
from .llama import Llama


class SmolLM3(Llama):
    nope_interval = 4
