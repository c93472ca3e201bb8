"""Pre-tokenizer regexes per `tokenizer.ggml.pre`, as llama.cpp's src/llama-vocab.cpp defines them.

A pre-tokenizer is a list of regexes applied in turn: each one splits every piece produced so far
into its matches and the text between them (llama.cpp's unicode_regex_split).
"""
from __future__ import annotations

import regex

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "llama3": [_LLAMA3],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "qwen2": [_QWEN2],
}
ALIASES = {
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "phi-2": "gpt2",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm",
    "exaone": "smollm", "minerva-7b": "smollm",
    "qwen2.5": "qwen2", "qwen-2.5": "qwen2", "stablelm2": "qwen2", "deepseek-r1-qwen": "qwen2",
}
# llama.cpp takes a whole pre-token as one token when the vocabulary has it (HF's ignore_merges).
IGNORE_MERGES = frozenset({"llama3"})


def canonical_name(pre: str) -> str | None:
    pre = ALIASES.get(pre, pre)
    return pre if pre in PRE_TOKENIZERS else None


class PreTokenizer:
    def __init__(self, name: str):
        self.patterns = [regex.compile(p) for p in PRE_TOKENIZERS[name]]

    def split(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self.patterns:
            out = []
            for piece in pieces:
                start = 0
                for m in pattern.finditer(piece):
                    if m.start() > start:
                        out.append(piece[start:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    start = m.end()
                if start < len(piece):
                    out.append(piece[start:])
            pieces = out
        return pieces
