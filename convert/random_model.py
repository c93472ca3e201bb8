"""A Llama-shaped GGUF of random weights, for measuring speed at sizes no test file has (a 7B
shape on a GPU) without downloading one.

Tensor types come from the same mix chooser as `ggrun convert` (Q4_K_M: Q6_K output, Q6_K for
some attn_v and ffn_down, Q4_K elsewhere). Quantizing billions of random weights would take
minutes and say nothing more, so each (row length, type) is quantized once for ROWS rows and
those blocks are repeated down the tensor: every byte is a valid block, the model runs, and its
text is noise.
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


SHAPE_7B = LlamaShape()


def _vocabulary(n: int) -> TokenizerData:
    """SentencePiece-style: <unk>, <s>, </s>, the 256 byte tokens, then filler words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    return TokenizerData("llama", tokens, types, scores=[-float(i) for i in range(n)], add_space_prefix=True)


def _tensor_shapes(s: LlamaShape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, GGML shape: row length first) in llama.cpp's file order."""
    name = ARCHITECTURES["llama"].tensor_name
    kv = s.n_embd // s.n_head * s.n_head_kv
    layer = [(T.ATTN_NORM, (s.n_embd,)), (T.ATTN_Q, (s.n_embd, s.n_embd)), (T.ATTN_K, (s.n_embd, kv)),
             (T.ATTN_V, (s.n_embd, kv)), (T.ATTN_OUT, (s.n_embd, s.n_embd)), (T.FFN_NORM, (s.n_embd,)),
             (T.FFN_GATE, (s.n_embd, s.n_ff)), (T.FFN_UP, (s.n_embd, s.n_ff)), (T.FFN_DOWN, (s.n_ff, s.n_embd))]
    return ([(name(T.TOKEN_EMBD), (s.n_embd, s.vocab_size))]
            + [(name(t, i), shape) for i in range(s.n_layer) for t, shape in layer]
            + [(name(T.OUTPUT_NORM), (s.n_embd,)), (name(T.OUTPUT), (s.n_embd, s.vocab_size))])


def write_random_llama(path: Path, shape: LlamaShape = SHAPE_7B, type_name: str = "Q4_K_M",
                       seed: int = 0, progress: bool = True) -> Summary:
    rng = np.random.default_rng(seed)
    blocks: dict = {}  # (row length, type) -> ROWS quantized rows

    def quantized_rows(n_cols, qtype, n_rows):
        key = (n_cols, qtype)
        if key not in blocks:
            blocks[key] = quantize(rng.standard_normal((ROWS, n_cols), dtype=np.float32) * 0.02, qtype)
        return np.tile(blocks[key], (-(-n_rows // ROWS), 1))[:n_rows]

    shapes = _tensor_shapes(shape)
    types = mix_types(type_name, dict(shapes), shape.n_layer, shape.n_head, shape.n_head_kv)
    tensors = []
    for name, dims in shapes:
        qtype = types[name]
        if len(dims) == 1:
            tensors.append(PlannedTensor(name, dims, qtype, lambda n=dims[0]: np.ones(n, dtype=np.float32)))
        else:
            tensors.append(PlannedTensor(name, dims, qtype, lambda d=dims, t=qtype: quantized_rows(d[0], t, d[1]),
                                         quantized=True))
    # the hyperparameter keys as the converter derives them from a Hugging Face config
    hf = model_from_config({
        "model_type": "llama", "num_hidden_layers": shape.n_layer, "hidden_size": shape.n_embd,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
        "intermediate_size": shape.n_ff, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.context_length, "rope_theta": 500000.0, "rms_norm_eps": 1e-5})
    special = {"bos": 1, "eos": 2, "unk": 0, "add_bos": True, "add_eos": False}
    metadata = model_metadata(f"random-llama-{shape.n_layer}x{shape.n_embd}", hf, type_name,
                              _vocabulary(shape.vocab_size), special)
    return write_gguf(path, "llama", metadata, tensors, progress)


@click.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--layers", "n_layer", default=SHAPE_7B.n_layer, show_default=True, type=click.IntRange(1))
@click.option("--embd", "n_embd", default=SHAPE_7B.n_embd, show_default=True, type=click.IntRange(64))
@click.option("--ff", "n_ff", default=SHAPE_7B.n_ff, show_default=True, type=click.IntRange(32))
@click.option("--heads", "n_head", default=SHAPE_7B.n_head, show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", "n_head_kv", default=SHAPE_7B.n_head_kv, show_default=True, type=click.IntRange(1))
@click.option("--vocab", "vocab_size", default=SHAPE_7B.vocab_size, show_default=True, type=click.IntRange(300))
@click.option("--type", "type_name", default="Q4_K_M", show_default=True,
              type=click.Choice(list(FILE_TYPES), case_sensitive=False))
def main(out, n_layer, n_embd, n_ff, n_head, n_head_kv, vocab_size, type_name):
    """Write a Llama of random weights to OUT (a GGUF file), by default Q4_K_M in the 7B shape,
    for benchmarks of a model that size (scripts/gpu_check); e.g. the 1B shape: --layers 16
    --embd 2048 --ff 8192 --heads 32 --kv-heads 8."""
    if n_embd % n_head or n_head % n_head_kv:
        raise click.BadParameter("--embd must divide into --heads, and --heads into --kv-heads")
    shape = LlamaShape(n_layer, n_embd, n_head, n_head_kv, n_ff, vocab_size)
    click.echo("\n".join(write_random_llama(out, shape, type_name).lines()))


if __name__ == "__main__":  # python -m convert.random_model OUT.gguf
    main()
