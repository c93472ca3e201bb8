"""A Llama-shaped GGUF of random weights, for measuring speed at sizes no test file has (a 7B
shape on a GPU) without downloading one; with experts, a Qwen3-MoE of that shape (per-head Q/K
norms, a router and 3-D expert tensors in every layer: the 30B-A3B shape and smaller), or a
gpt-oss (biases, attention sinks, a 128-token window on every other layer: gpt-oss-20b's shape).

Tensor types come from the same mix chooser as `ggrun convert` (Q4_K_M: Q6_K output, Q6_K for
some attn_v and ffn_down, Q4_K elsewhere). Quantizing billions of random weights would take
minutes and say nothing more, so each (row length, type) is quantized once for ROWS rows and
those blocks are repeated down the tensor: every byte is a valid block, the model runs, and its
text is noise. (Small test models take tiled=False: repeated output rows would give tokens equal
logits, and greedy choices between them would rest on rounding.)
"""
from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def key_length(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPE_7B = LlamaShape()
# Qwen3-30B-A3B's shape
SHAPE_30B_A3B = LlamaShape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, n_ff=6144, vocab_size=151936,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, head_dim=128)
# gpt-oss-20b's
SHAPE_GPT_OSS_20B = LlamaShape(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, n_ff=2880, vocab_size=201088,
                               n_expert=32, n_expert_used=4, n_ff_exp=2880, head_dim=64, gpt_oss=True)


def _vocabulary(n: int) -> TokenizerData:
    """SentencePiece-style: <unk>, <s>, </s>, the 256 byte tokens, then filler words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    return TokenizerData("llama", tokens, types, scores=[-float(i) for i in range(n)], add_space_prefix=True)


def _architecture(s: LlamaShape) -> str:
    return "gpt-oss" if s.gpt_oss else "qwen3moe" if s.n_expert else "llama"


def _tensor_shapes(s: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGML shape: row length first) in llama.cpp's file order."""
    name = ARCHITECTURES[_architecture(s)].tensor_name
    q, kv = s.key_length * s.n_head, s.key_length * s.n_head_kv
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


def write_random_llama(path: Path, shape: LlamaShape = SHAPE_7B, type_name: str = "Q4_K_M",
                       seed: int = 0, progress: bool = True, tiled: bool = True) -> Summary:
    rng = np.random.default_rng(seed)
    blocks: dict = {}  # (row length, type) -> ROWS quantized rows

    def quantized_rows(n_cols, qtype, n_rows):
        if not tiled:
            return quantize(rng.standard_normal((n_rows, n_cols), dtype=np.float32) * 0.02, qtype)
        key = (n_cols, qtype)
        if key not in blocks:
            blocks[key] = quantize(rng.standard_normal((ROWS, n_cols), dtype=np.float32) * 0.02, qtype)
        return np.tile(blocks[key], (-(-n_rows // ROWS), 1))[:n_rows]

    shapes = _tensor_shapes(shape)
    types = mix_types(type_name, dict(shapes), shape.n_layer, shape.n_head, shape.n_head_kv, shape.n_expert)
    tensors = []
    for name, dims in shapes:
        qtype = types[name]
        if len(dims) == 1:
            tensors.append(PlannedTensor(name, dims, qtype, lambda n=dims[0]: np.ones(n, dtype=np.float32)))
        else:  # (a 3-D expert tensor's rows: every expert's one after the other)
            tensors.append(PlannedTensor(name, dims, qtype, lambda d=dims, t=qtype: quantized_rows(
                d[0], t, int(np.prod(d[1:]))).reshape(*reversed(d[1:]), -1), quantized=True))
    # the hyperparameter keys as the converter derives them from a Hugging Face config
    config = {"model_type": "llama", "num_hidden_layers": shape.n_layer, "hidden_size": shape.n_embd,
              "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
              "intermediate_size": shape.n_ff, "vocab_size": shape.vocab_size,
              "max_position_embeddings": shape.context_length, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    if shape.gpt_oss:
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


@click.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--layers", "n_layer", default=SHAPE_7B.n_layer, show_default=True, type=click.IntRange(1))
@click.option("--embd", "n_embd", default=SHAPE_7B.n_embd, show_default=True, type=click.IntRange(64))
@click.option("--ff", "n_ff", default=SHAPE_7B.n_ff, show_default=True, type=click.IntRange(32))
@click.option("--heads", "n_head", default=SHAPE_7B.n_head, show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", "n_head_kv", default=SHAPE_7B.n_head_kv, show_default=True, type=click.IntRange(1))
@click.option("--vocab", "vocab_size", default=SHAPE_7B.vocab_size, show_default=True, type=click.IntRange(300))
@click.option("--experts", "n_expert", default=0, show_default=True, type=click.IntRange(0),
              help="Experts per layer: a Qwen3-MoE (0: a dense Llama).")
@click.option("--experts-used", "n_expert_used", default=8, show_default=True, type=click.IntRange(1))
@click.option("--expert-ff", "n_ff_exp", default=768, show_default=True, type=click.IntRange(32))
@click.option("--head-dim", default=0, type=click.IntRange(0), help="Key length per head (default: embd / heads).")
@click.option("--gpt-oss", is_flag=True, help="A gpt-oss of this shape (with --experts; --expert-ff its FFN).")
@click.option("--type", "type_name", default="Q4_K_M", show_default=True,
              type=click.Choice(list(FILE_TYPES), case_sensitive=False))
def main(out, n_layer, n_embd, n_ff, n_head, n_head_kv, vocab_size, n_expert, n_expert_used, n_ff_exp, head_dim,
         gpt_oss, type_name):
    """Write a Llama of random weights to OUT (a GGUF file), by default Q4_K_M in the 7B shape,
    for benchmarks of a model that size (scripts/gpu_check); e.g. the 1B shape: --layers 16
    --embd 2048 --ff 8192 --heads 32 --kv-heads 8; Qwen3-30B-A3B's: --layers 48 --embd 2048
    --heads 32 --kv-heads 4 --head-dim 128 --experts 128 --experts-used 8 --expert-ff 768
    --vocab 151936; gpt-oss-20b's: --gpt-oss --layers 24 --embd 2880 --heads 64 --kv-heads 8 --head-dim 64
    --experts 32 --experts-used 4 --expert-ff 2880 --ff 2880 --vocab 201088 --type MXFP4_MOE."""
    if (not head_dim and n_embd % n_head) or n_head % n_head_kv:
        raise click.BadParameter("--embd must divide into --heads, and --heads into --kv-heads")
    if n_expert and n_expert_used > n_expert:
        raise click.BadParameter("--experts-used must be at most --experts")
    if gpt_oss and not n_expert:
        raise click.BadParameter("a gpt-oss has --experts")
    shape = LlamaShape(n_layer, n_embd, n_head, n_head_kv, n_ff, vocab_size, n_expert=n_expert,
                       n_expert_used=n_expert_used if n_expert else 0, n_ff_exp=n_ff_exp if n_expert else 0,
                       head_dim=head_dim, gpt_oss=gpt_oss)
    click.echo("\n".join(write_random_llama(out, shape, type_name).lines()))


if __name__ == "__main__":  # python -m convert.random_model OUT.gguf
    main()
