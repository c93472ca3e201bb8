"""A Llama-shaped GGUF of random weights, for measuring speed at sizes no test file has (a 7B
shape on a GPU) without downloading one; with experts, a Qwen3-MoE of that shape (per-head Q/K
norms, a router and 3-D expert tensors in every layer: the 30B-A3B shape and smaller), or a
gpt-oss (biases, attention sinks, a 128-token window on every other layer: gpt-oss-20b's shape);
with a gated DeltaNet's heads, a Qwen3.5 (three DeltaNet layers in four, the fourth gated
attention: the 2B shape), with experts a Qwen3.5-MoE (beside a shared expert: the 35B-A3B kind).

Tensor types come from the same mix chooser as `ggrun convert` (Q4_K_M: Q6_K output, Q6_K for
some attn_v and ffn_down, Q4_K elsewhere). Quantizing billions of random weights would take
minutes and say nothing more, so each (row length, type) is quantized once for ROWS rows and
those blocks are repeated down the tensor: every byte is a valid block, the model runs, and its
text is noise. (Small test models take tiled=False: repeated output rows would give tokens equal
logits, and greedy choices between them would rest on rounding.) Norms are ones; a DeltaNet's
decays A are -1 and its time-step biases 0, its convolution kernels small random numbers, so
that its state stays bounded and the model computes finite numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
from gguf import MODEL_TENSOR as T

from gguf_io.architectures import ARCHITECTURES

from .convert import model_metadata
from .gguf_out import PlannedTensor, Summary, write_gguf
from .hf_model import model_from_config
from .hf_tokenizer import TokenizerData
from .mixes import FILE_TYPES, mix_types
from .quants import quantize

ROWS = 256


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int = 32
    n_embd: int = 4096
    n_head: int = 32
    n_head_kv: int = 8
    n_ff: int = 14336
    vocab_size: int = 32000
    context_length: int = 4096
    n_expert: int = 0         # > 0: a Qwen3-MoE of n_expert experts per layer, n_expert_used per token
    n_expert_used: int = 0
    n_ff_exp: int = 0         # one expert's hidden size
    head_dim: int = 0         # 0: n_embd / n_head
    gpt_oss: bool = False     # a gpt-oss of this shape (with experts)
    # > 0: a Qwen3.5 (with experts a Qwen3.5-MoE; n_ff 0: no dense MLP width in its file, as Qwen's
    # config gives none): its gated DeltaNet's key and value heads, of linear_head_dim each
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_head_dim: int = 128
    linear_conv_kernel: int = 4
    full_attention_interval: int = 4  # every this many layers one is attention, the others DeltaNet
    n_ff_shexp: int = 0       # a shared expert's hidden size (0: none)
    tied: bool = False        # the output matrix is the token embedding's (no output tensor)

    @property
    def key_length(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def qwen35(self) -> bool:
        return self.linear_k_heads > 0

    def recurrent(self, i: int) -> bool:
        """Whether layer i is a DeltaNet (a Qwen3.5's)."""
        return self.qwen35 and (i + 1) % self.full_attention_interval != 0


SHAPE_7B = LlamaShape()
# Qwen3-30B-A3B's shape
SHAPE_30B_A3B = LlamaShape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, n_ff=6144, vocab_size=151936,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, head_dim=128)
# gpt-oss-20b's
SHAPE_GPT_OSS_20B = LlamaShape(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, n_ff=2880, vocab_size=201088,
                               n_expert=32, n_expert_used=4, n_ff_exp=2880, head_dim=64, gpt_oss=True)
# Qwen3.5-2B's: gated attention on every fourth layer (RoPE on a quarter of each 256-wide head),
# DeltaNets of 16 key and 16 value heads of 128 between, tied embeddings
SHAPE_QWEN35_2B = LlamaShape(n_layer=24, n_embd=2048, n_head=8, n_head_kv=2, n_ff=6144, vocab_size=248320,
                             head_dim=256, linear_k_heads=16, linear_v_heads=16, tied=True)
# a Qwen3.5-MoE of the 30B-A3B shape's depth and width (not Qwen3.5-35B-A3B's own 40 layers of 256
# experts): Qwen3.5's layers, DeltaNets of 16 key and 32 value heads, a shared expert beside the 128
SHAPE_QWEN35_35B_A3B = LlamaShape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, n_ff=0, vocab_size=248320,
                                  n_expert=128, n_expert_used=8, n_ff_exp=768, head_dim=128, linear_k_heads=16,
                                  linear_v_heads=32, n_ff_shexp=768)
# --shape's names
SHAPES = {"7b": SHAPE_7B, "30b-a3b": SHAPE_30B_A3B, "gpt-oss-20b": SHAPE_GPT_OSS_20B, "qwen35-2b": SHAPE_QWEN35_2B,
          "qwen35-35b-a3b": SHAPE_QWEN35_35B_A3B}


def _vocabulary(n: int) -> TokenizerData:
    """SentencePiece-style: <unk>, <s>, </s>, the 256 byte tokens, then filler words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    return TokenizerData("llama", tokens, types, scores=[-float(i) for i in range(n)], add_space_prefix=True)


def _architecture(s: LlamaShape) -> str:
    if s.qwen35:
        return "qwen35moe" if s.n_expert else "qwen35"
    return "gpt-oss" if s.gpt_oss else "qwen3moe" if s.n_expert else "llama"


def _qwen35_layer(s: LlamaShape, i: int) -> list:
    """A Qwen3.5 layer's tensors ((tensor, suffix) or tensor, GGML shape) in the order llama.cpp's
    converter writes them: a DeltaNet or gated attention (its query projection twice as wide: the
    query and its gate), then the feed-forward, dense or experts beside a shared expert."""
    q, kv, v = s.key_length * s.n_head, s.key_length * s.n_head_kv, s.linear_v_heads * s.linear_head_dim
    conv = 2 * s.linear_k_heads * s.linear_head_dim + v  # (Q, K and V, convolved together)
    if s.recurrent(i):
        mixer = [(T.ATTN_NORM, (s.n_embd,)), ((T.SSM_A, None), (s.linear_v_heads,)),
                 (T.SSM_CONV1D, (s.linear_conv_kernel, conv)), ((T.SSM_DT, "bias"), (s.linear_v_heads,)),
                 (T.SSM_ALPHA, (s.n_embd, s.linear_v_heads)), (T.SSM_BETA, (s.n_embd, s.linear_v_heads)),
                 (T.ATTN_QKV, (s.n_embd, conv)), (T.ATTN_GATE, (s.n_embd, v)), (T.SSM_NORM, (s.linear_head_dim,)),
                 (T.SSM_OUT, (v, s.n_embd))]
    else:
        mixer = [(T.ATTN_NORM, (s.n_embd,))]
    if s.n_expert:
        e, f, fs = s.n_expert, s.n_ff_exp, s.n_ff_shexp
        ffn = [(T.FFN_DOWN_EXP, (f, s.n_embd, e)), (T.FFN_GATE_EXP, (s.n_embd, f, e)),
               (T.FFN_UP_EXP, (s.n_embd, f, e)), (T.FFN_GATE_INP, (s.n_embd, e))]
        if fs:
            ffn += [(T.FFN_DOWN_SHEXP, (fs, s.n_embd)), (T.FFN_GATE_SHEXP, (s.n_embd, fs)),
                    (T.FFN_UP_SHEXP, (s.n_embd, fs)), (T.FFN_GATE_INP_SHEXP, (s.n_embd, 1))]
    else:
        ffn = [(T.FFN_DOWN, (s.n_ff, s.n_embd)), (T.FFN_GATE, (s.n_embd, s.n_ff)), (T.FFN_UP, (s.n_embd, s.n_ff))]
    attention = [] if s.recurrent(i) else [
        (T.ATTN_K_NORM, (s.key_length,)), (T.ATTN_K, (s.n_embd, kv)), (T.ATTN_OUT, (q, s.n_embd)),
        (T.ATTN_Q_NORM, (s.key_length,)), (T.ATTN_Q, (s.n_embd, 2 * q)), (T.ATTN_V, (s.n_embd, kv))]
    return mixer + ffn + [(T.ATTN_POST_NORM, (s.n_embd,))] + attention


def _tensor_shapes(s: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGML shape: row length first) in llama.cpp's file order."""
    name = ARCHITECTURES[_architecture(s)].tensor_name
    q, kv = s.key_length * s.n_head, s.key_length * s.n_head_kv
    if s.qwen35:
        return ([(name(T.TOKEN_EMBD), (s.n_embd, s.vocab_size))]
                + [(name(t[0], i, t[1]) if isinstance(t, tuple) else name(t, i), shape)
                   for i in range(s.n_layer) for t, shape in _qwen35_layer(s, i)]
                + [(name(T.OUTPUT_NORM), (s.n_embd,))]
                + ([] if s.tied else [(name(T.OUTPUT), (s.n_embd, s.vocab_size))]))
    layer = [(T.ATTN_NORM, (s.n_embd,)), (T.ATTN_Q, (s.n_embd, q)), (T.ATTN_K, (s.n_embd, kv)),
             (T.ATTN_V, (s.n_embd, kv)), (T.ATTN_OUT, (q, s.n_embd)),
             (T.ATTN_POST_NORM if s.gpt_oss else T.FFN_NORM, (s.n_embd,))]
    if s.gpt_oss:
        e, f = s.n_expert, s.n_ff_exp
        biases = [((T.ATTN_Q, "bias"), (q,)), ((T.ATTN_K, "bias"), (kv,)), ((T.ATTN_V, "bias"), (kv,)),
                  ((T.ATTN_OUT, "bias"), (s.n_embd,)), (T.ATTN_SINKS, (s.n_head,)), ((T.FFN_GATE_INP, "bias"), (e,)),
                  ((T.FFN_GATE_EXP, "bias"), (f, e)), ((T.FFN_UP_EXP, "bias"), (f, e)),
                  ((T.FFN_DOWN_EXP, "bias"), (s.n_embd, e))]
        layer += biases + [(T.FFN_GATE_INP, (s.n_embd, e)), (T.FFN_GATE_EXP, (s.n_embd, f, e)),
                           (T.FFN_UP_EXP, (s.n_embd, f, e)), (T.FFN_DOWN_EXP, (f, s.n_embd, e))]
    elif s.n_expert:
        e, f = s.n_expert, s.n_ff_exp
        layer += [(T.ATTN_Q_NORM, (s.key_length,)), (T.ATTN_K_NORM, (s.key_length,)),
                  (T.FFN_GATE_INP, (s.n_embd, e)), (T.FFN_GATE_EXP, (s.n_embd, f, e)),
                  (T.FFN_UP_EXP, (s.n_embd, f, e)), (T.FFN_DOWN_EXP, (f, s.n_embd, e))]
    else:
        layer += [(T.FFN_GATE, (s.n_embd, s.n_ff)), (T.FFN_UP, (s.n_embd, s.n_ff)), (T.FFN_DOWN, (s.n_ff, s.n_embd))]
    return ([(name(T.TOKEN_EMBD), (s.n_embd, s.vocab_size))]
            + [(name(t[0], i, t[1]) if isinstance(t, tuple) else name(t, i), shape)
               for i in range(s.n_layer) for t, shape in layer]
            + [(name(T.OUTPUT_NORM), (s.n_embd,)), (name(T.OUTPUT), (s.n_embd, s.vocab_size))])


def _qwen35_config(s: LlamaShape) -> dict:
    """A Qwen3.5's (or Qwen3.5-MoE's) config.json entries of shape s, as transformers writes them:
    its layers, DeltaNet sizes, RoPE on a quarter of each head (multimodal sections as Qwen's, in
    proportion to the rotated pairs), experts."""
    pairs = s.key_length // 4 // 2
    side = round(pairs * 11 / 32)
    config = dict(model_type="qwen3_5_moe_text" if s.n_expert else "qwen3_5_text", head_dim=s.key_length,
                  layer_types=["linear_attention" if s.recurrent(i) else "full_attention" for i in range(s.n_layer)],
                  full_attention_interval=s.full_attention_interval, linear_conv_kernel_dim=s.linear_conv_kernel,
                  linear_key_head_dim=s.linear_head_dim, linear_value_head_dim=s.linear_head_dim,
                  linear_num_key_heads=s.linear_k_heads, linear_num_value_heads=s.linear_v_heads,
                  tie_word_embeddings=s.tied, rms_norm_eps=1e-6,
                  rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                       mrope_section=[side, side, pairs - 2 * side], mrope_interleaved=True))
    if s.n_expert:
        config.update(num_experts=s.n_expert, num_experts_per_tok=s.n_expert_used, moe_intermediate_size=s.n_ff_exp)
        if s.n_ff_shexp:
            config["shared_expert_intermediate_size"] = s.n_ff_shexp
    return config


def write_random_llama(path: Path, shape: LlamaShape = SHAPE_7B, type_name: str = "Q4_K_M",
                       seed: int = 0, progress: bool = True, tiled: bool = True) -> Summary:
    rng = np.random.default_rng(seed)
    blocks: dict = {}  # (row length, type) -> ROWS quantized rows

    def quantized_rows(n_cols, qtype, n_rows, scale=0.02):
        if not tiled:
            return quantize(rng.standard_normal((n_rows, n_cols), dtype=np.float32) * scale, qtype)
        key = (n_cols, qtype, scale)
        if key not in blocks:
            blocks[key] = quantize(rng.standard_normal((ROWS, n_cols), dtype=np.float32) * scale, qtype)
        return np.tile(blocks[key], (-(-n_rows // ROWS), 1))[:n_rows]

    shapes = _tensor_shapes(shape)
    types = mix_types(type_name, dict(shapes), shape.n_layer, shape.n_head, shape.n_head_kv, shape.n_expert)
    tensors = []
    for name, dims in shapes:
        qtype = types[name]
        if len(dims) == 1:  # (norms 1; a DeltaNet's A -1 and its time-step biases 0)
            value = -1.0 if name.endswith(".ssm_a") else 0.0 if name.endswith("ssm_dt.bias") else 1.0
            tensors.append(PlannedTensor(name, dims, qtype, lambda n=dims[0], v=value: np.full(n, v, np.float32)))
        else:  # (a 3-D expert tensor's rows: every expert's one after the other)
            scale = 0.25 if "ssm_conv1d" in name else 0.02  # (a kernel of a few taps)
            tensors.append(PlannedTensor(name, dims, qtype, lambda d=dims, t=qtype, sc=scale: quantized_rows(
                d[0], t, int(np.prod(d[1:])), sc).reshape(*reversed(d[1:]), -1), quantized=True))
    # the hyperparameter keys as the converter derives them from a Hugging Face config
    config = {"model_type": "llama", "num_hidden_layers": shape.n_layer, "hidden_size": shape.n_embd,
              "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
              "intermediate_size": shape.n_ff, "vocab_size": shape.vocab_size,
              "max_position_embeddings": shape.context_length, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    if shape.qwen35:
        config.update(_qwen35_config(shape))
        if not shape.n_ff:  # (a mixture's without a dense width, as Qwen's config)
            del config["intermediate_size"]
    elif shape.gpt_oss:
        config.update(model_type="gpt_oss", num_local_experts=shape.n_expert, num_experts_per_tok=shape.n_expert_used,
                      head_dim=shape.key_length, sliding_window=128, rope_parameters=dict(
                          rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, rope_theta=150000.0,
                          original_max_position_embeddings=4096))
    elif shape.n_expert:
        config.update(model_type="qwen3_moe", num_experts=shape.n_expert, num_experts_per_tok=shape.n_expert_used,
                      moe_intermediate_size=shape.n_ff_exp, head_dim=shape.key_length)
    hf = model_from_config(config)
    special = {"bos": 1, "eos": 2, "unk": 0, "add_bos": True, "add_eos": False}
    metadata = model_metadata(f"random-{hf.arch.name}-{shape.n_layer}x{shape.n_embd}", hf, type_name,
                              _vocabulary(shape.vocab_size), special)
    return write_gguf(path, hf.arch.name, metadata, tensors, progress)


def _size_option(flag: str, dest: str, lo: int, what: str):
    return click.option(flag, dest, default=None, type=click.IntRange(lo), help=f"{what} [default: the shape's]")


@click.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--shape", "shape_name", default="7b", show_default=True, type=click.Choice(list(SHAPES)),
              help="The shape the other options change: a Llama 7B, Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-2B, or a "
                   "Qwen3.5-MoE of the 30B-A3B shape's depth and width.")
@_size_option("--layers", "n_layer", 1, "Layers.")
@_size_option("--embd", "n_embd", 64, "Embedding width.")
@_size_option("--ff", "n_ff", 32, "Dense feed-forward width.")
@_size_option("--heads", "n_head", 1, "Attention heads.")
@_size_option("--kv-heads", "n_head_kv", 1, "KV heads.")
@_size_option("--vocab", "vocab_size", 300, "Vocabulary size.")
@_size_option("--experts", "n_expert", 0, "Experts per layer: on a dense shape a Qwen3-MoE (with --experts-used 8 "
              "and --expert-ff 768 unless given), on a Qwen3.5 a Qwen3.5-MoE; 0: dense.")
@_size_option("--experts-used", "n_expert_used", 1, "Experts per token.")
@_size_option("--expert-ff", "n_ff_exp", 32, "One expert's feed-forward width.")
@_size_option("--shared-expert-ff", "n_ff_shexp", 0, "A shared expert's feed-forward width (Qwen3.5-MoE; 0: none).")
@_size_option("--head-dim", "head_dim", 0, "Key length per head (0: embd / heads).")
@click.option("--gpt-oss", is_flag=True, help="A gpt-oss of this shape (with --experts; --expert-ff its FFN).")
@click.option("--type", "type_name", default="Q4_K_M", show_default=True,
              type=click.Choice(list(FILE_TYPES), case_sensitive=False))
def main(out, shape_name, gpt_oss, type_name, **sizes):
    """Write a model of random weights to OUT (a GGUF file), by default a Llama of the 7B shape at
    Q4_K_M, for benchmarks of a model that size (scripts/gpu_check). --shape picks another shape,
    the other options change it; e.g. the 1B shape: --layers 16 --embd 2048 --ff 8192 --heads 32
    --kv-heads 8; Qwen3-30B-A3B's: --shape 30b-a3b (or --layers 48 --embd 2048 --heads 32 --kv-heads 4
    --head-dim 128 --experts 128 --experts-used 8 --expert-ff 768 --vocab 151936); gpt-oss-20b's:
    --shape gpt-oss-20b --type MXFP4_MOE; Qwen3.5-2B's: --shape qwen35-2b; a Qwen3.5-MoE:
    --shape qwen35-35b-a3b."""
    base = SHAPES[shape_name]
    given = {k: v for k, v in sizes.items() if v is not None}
    if gpt_oss:
        given["gpt_oss"] = True
    if given.get("n_expert") == 0:  # (dense)
        given.update(n_expert_used=0, n_ff_exp=0, n_ff_shexp=0, gpt_oss=False)
    elif given.get("n_expert") and not base.n_expert:  # (experts on a dense shape)
        given = {"n_expert_used": 8, "n_ff_exp": 768, **given}
    shape = replace(base, **given)
    if (not shape.head_dim and shape.n_embd % shape.n_head) or shape.n_head % shape.n_head_kv:
        raise click.BadParameter("--embd must divide into --heads, and --heads into --kv-heads")
    if shape.n_expert and shape.n_expert_used > shape.n_expert:
        raise click.BadParameter("--experts-used must be at most --experts")
    if shape.gpt_oss and (not shape.n_expert or shape.qwen35):
        raise click.BadParameter("a gpt-oss has --experts (and is no Qwen3.5)")
    if not shape.n_expert and not shape.n_ff:
        raise click.BadParameter("a dense model has a feed-forward width (--ff)")
    if shape.n_ff_shexp and not shape.qwen35:
        raise click.BadParameter("--shared-expert-ff is a Qwen3.5-MoE's")
    click.echo("\n".join(write_random_llama(out, shape, type_name).lines()))


if __name__ == "__main__":  # python -m convert.random_model OUT.gguf
    main()
