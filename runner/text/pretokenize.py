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
# Qwen 3.5: letters with their combining marks
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss, Llama 4) as llama.cpp rewrites its tokenizer.json regex: "upper" is a letter
# that is not a-z, "lower" one that is not A-Z (so a lowercase letter outside ASCII counts as both)
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letters: the Latin, Greek, Cyrillic, Armenian, Georgian ... ranges its tokenizer.json lists
_DEEPSEEK_LETTERS = (
    r"A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    r"\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    r"\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    r"\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    r"\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    r"\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    r"\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    r"\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")

PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "llama3": [_LLAMA3],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    "gpt-4o": [_GPT4O],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    # (\Z where llama.cpp writes $: the end of the piece, never before a final newline)
    "deepseek-llm": [r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                     r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+\Z", _CJK, r"\p{N}+"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "gemma4": [r"[^\n]+|[\n]+"],  # (the gemma4 tokenizer model's own: whole lines and runs of newlines)
}
ALIASES = {
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3", "lfm2": "llama3",
    "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "phi-2": "gpt2",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm",
    "exaone": "smollm", "minerva-7b": "smollm",
    "qwen2.5": "qwen2", "qwen-2.5": "qwen2", "stablelm2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "llama4": "gpt-4o", "kanana2": "gpt-4o", "talkie": "gpt-4o",
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
