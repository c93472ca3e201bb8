"""A fixed set of strings that tokenizers get wrong: unicode, emoji, CJK, whitespace runs, digits,
code, contractions and special-token text. Deterministic, so failures reproduce."""
import random

BASE = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t\n  \n", "a", " a", "a ", "  a  ",
    "Hello world", "Hello  world", "Hello\u00a0world", "hello\tworld", "HELLO WORLD!!!",
    "don't", "I'm", "we'll", "they've", "she'd", "it's", "DON'T", "I'M", "We'Ll", "'s", "''", "'''",
    "can't won't shouldn't", "rock 'n' roll", "O'Neil's",
    "0", "7", "12", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "-42", "+1e-9",
    "2024-01-01", "10:30am", "v1.2.3", "0x1F", "١٢٣", "½ ¾", "⅓", "①②③",
    "日本語", "日本語のテキスト", "中文字符测试", "한국어 텍스트", "Привет, мир!", "Γειά σου Κόσμε",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu",
    "café naïve résumé", "Ångström", "straße", "ﬁ ligature", "e\u0301", "ñ vs n\u0303",
    "🎉", "🎉🎉🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇩🇪", "❤️", "a🎉b", " 🎉 ", "😀 smile 😀",
    "\u200b", "\u200d", "\ufeffBOM", "\u2028", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝟘𝟙𝟚",
    "def f(x):\n    return x**2", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "if __name__ == '__main__':\n\tmain()", "<div class=\"x\">hi</div>", "SELECT * FROM t WHERE id=1;",
    "a->b && c || !d", "x += 1  # comment", "    indented\n        more", "}}}}", "((((", "....",
    "!!!", "???", "---", "___", "***", "===", "~~~", "$$$", "@user #tag", "http://example.com/a?b=c&d=e",
    "user@example.com", "C:\\path\\to\\file.txt", "/usr/bin/env python3", "#!/bin/bash", "`code`",
    "```python\nprint(1)\n```", "<|im_start|>", "<|im_end|>", "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>", "text<|im_end|>more", "<|im_start|><|im_end|>", "<|im_start", "im_end|>",
    "<s>", "</s>", "<start_of_turn>user\nhi<end_of_turn>", "<unk>", "<pad>",
    "The quick brown fox jumps over the lazy dog.", "A  B   C    D", "end.", "   leading", "trailing   ",
    "mixed\ttabs and  spaces", "line1\nline2\r\nline3\rline4", "\n\n\n\nparagraph", "word\n",
]

PIECES = ["hello", " ", "  ", "\n", "\t", "123", "4567", "日本", "🎉", "don't", "I'LL", "x=1;", "é",
          "<|im_end|>", "(", ")", "...", "Ω", "ß", "\u00a0", "ab12cd", "__init__", "🇫🇷", "   \n"]


def hard_strings(n_random: int = 120) -> list[str]:
    rng = random.Random(1234)
    out = list(BASE)
    for _ in range(n_random):
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(2, 8))))
    return out
