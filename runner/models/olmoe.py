"""OLMoE: the Llama block with NeoX rotary pairing, RMSNorm over the whole query and key
projections (not per head), and a mixture of experts in every layer (the shared decoder's MoE
slot, loaded wherever a layer has a router)."""
from .llama import Llama


class OLMoE(Llama):
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    qk_norm_per_head = False
