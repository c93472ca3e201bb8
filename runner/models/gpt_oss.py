"""gpt-oss: the Llama block with biases on every projection and expert, attention sinks (a
logit per head in each softmax), NeoX rotary pairing with YaRN from the file, sliding-window
layers alternating with global ones (declared in gguf_io.architectures), and a mixture of
experts in every layer, routed by the softmax over the chosen experts' logits and gated by a
clamped SwiGLU. Its pre-MLP norm is the file's post_attention_norm."""
from gguf import MODEL_TENSOR as T

from .decoder import Decoder


class GptOss(Decoder):
    ffn_norm_tensor = T.ATTN_POST_NORM
    rope_neox = True
    extra_attention_tensors = ("bq", "bk", "bv", "bo", "sinks")
    gated_activation = "clamped_swiglu"
    swiglu_clamp = (1.702, 7.0)  # (alpha, limit): llama.cpp's, fixed for the architecture
