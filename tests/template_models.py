"""Tiny random-weight models that carry a real chat template and a family's control tokens: for
what depends on the template and the vocabulary, not on the weights (tool-call formats, reasoning)."""
from __future__ import annotations

from pathlib import Path

CONTROL = 3  # (gguf's TokenType.CONTROL)


def write_template_model(path: Path, template: str, controls=(), words=()) -> Path:
    """A one-layer random llama (SentencePiece vocabulary of byte tokens and filler words) at path,
    its tokens from 300 on replaced by the control tokens, and from 300 + max(10, controls) by a
    space, "▁", and the words (plain tokens, without the leading space of the filler words); the
    template in its header."""
    from gguf import GGUFValueType as V

    from convert.gguf_out import PlannedTensor, write_gguf
    from convert.random_model import LlamaShape, write_random_llama
    from gguf_io import GGUFFile
    plain = path.with_suffix(".plain.gguf")
    write_random_llama(plain, LlamaShape(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, vocab_size=600),
                       "F32", progress=False)
    f = GGUFFile(plain)
    tokens, types = list(f.get("tokenizer.ggml.tokens")), [int(t) for t in f.get("tokenizer.ggml.token_type")]
    for i, marker in enumerate(controls):
        tokens[300 + i], types[300 + i] = marker, CONTROL
    for i, word in enumerate(("\u2581", *words)):  # (a space: SentencePiece's byte fallback would spell "▁")
        tokens[300 + max(10, len(controls)) + i] = word
    replaced = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    metadata = [(k, replaced[k] if k in replaced else m.value.tolist() if hasattr(m.value, "tolist") else m.value,
                 m.type, m.item_type) for k, m in f.metadata.items() if k != "general.architecture"]
    metadata.append(("tokenizer.chat_template", template, V.STRING, None))
    tensors = [PlannedTensor(name, t.shape, t.type, lambda n=name: f.tensor_bytes(n), quantized=True)
               for name, t in f.tensors.items()]
    return write_gguf(path, f.architecture, metadata, tensors, progress=False).path
