"""LFM2: a Llama-like block (per-head Q/K norms, NeoX rotary pairing) whose mixer is, on most
layers, a gated short convolution instead of attention: in_proj gives B, C and x; the
convolution (kernel K, depthwise, causal, with the last K - 1 inputs of the sequence as its state)
runs over B * x; C gates its output, out_proj projects it. Its final norm is token_embd_norm."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR as T

from runner.engine.recurrent_state import CONV

from .llama import Llama


@dataclass
class ShortConv:
    in_proj: object    # n_embd -> 3 n_embd: B, C, x
    kernel: object     # (n_embd, K)
    out_proj: object


class LFM2(Llama):
    rope_neox = True
    extra_attention_tensors = ("q_norm", "k_norm")
    output_norm_tensor = T.TOKEN_EMBD_NORM

    def load_recurrent(self, weights, i: int) -> ShortConv:
        n, k = self.params.n_embd, self.params.conv_kernel
        return ShortConv(weights.matrix(T.SHORTCONV_INPROJ, n, 3 * n, i), weights.small_table(T.SHORTCONV_CONV, k, n, i),
                         weights.matrix(T.SHORTCONV_OUTPROJ, n, n, i))

    @staticmethod
    def state_shapes(p) -> dict:
        return {CONV: (p.conv_kernel - 1, p.n_embd)}

    def recurrent(self, conv: ShortConv, h, cache, i: int):
        be, n = self.backend, self.params.n_embd
        b, c, x = be.split(be.matmul(conv.in_proj, h), [n, n, n])
        bx = b * x
        y = self.each_sequence(cache, h.shape[0], lambda rows, seq: be.short_conv(
            bx[rows], conv.kernel, seq.recurrent.conv_history(i, bx[rows])))
        return be.matmul(conv.out_proj, c * y)


class LFM2MoE(LFM2):
    """LFM2-MoE: LFM2's blocks, the feed-forward of all but the leading dense layers a mixture of
    experts under a sigmoid router, each layer's selection bias (exp_probs_b) added to choose them."""
    expert_selection_bias = True
