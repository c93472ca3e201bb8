"""Writing llguidance's Lark grammars: literal text with the vocabulary's control tokens as
those tokens (a grammar's text can never match a control token: its bytes are behind 0xff), JSON
values held to a schema, and text up to a marker."""
from __future__ import annotations

import json
import re

from gguf import TokenType

WS = r"/[ \t\n]*/"              # whitespace where a format allows some
TEXT_RULE = "TEXT: /(.|\\n)*/"  # any text (never a control token)


class Literals:
    """Lark for literal text: a control token of the vocabulary as that token (`<[id]>`), other
    text as a string; `until(end)` is any text up to and including end."""

    def __init__(self, control: dict[str, int], json_options: dict | None = None):
        self.control, self.json_options = control, json_options
        self.rules: list[str] = []
        self._named = 0
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(control, key=len, reverse=True))) \
            if control else None

    def __call__(self, text: str) -> str:
        if not text:
            return ""
        parts, pos = [], 0
        for m in (self._pattern.finditer(text) if self._pattern else ()):
            if m.start() > pos:
                parts.append(json.dumps(text[pos:m.start()]))
            parts.append(f"<[{self.control[m.group()]}]>")
            pos = m.end()
        if pos < len(text):
            parts.append(json.dumps(text[pos:]))
        return " ".join(parts)

    def json(self, schema) -> str:
        """A JSON value the schema validates."""
        if self.json_options and isinstance(schema, dict):
            schema = {"x-guidance": self.json_options, **schema}
        return "%json " + json.dumps(schema, ensure_ascii=False)

    def fresh(self, prefix: str) -> str:
        """A rule name not used before in this grammar."""
        self._named += 1
        return f"{prefix}_{self._named}"

    def ending(self, regex: str, end: str) -> str:
        """Text matching regex (Lark's /.../ body), then end: the regex stops at end's first
        occurrence where end is text (a lazy lexeme), and cannot run into it where end is a
        control token."""
        if self._pattern and self._pattern.match(end):
            return f"/{regex}/ {self(end)}"
        name = self.fresh("text")
        self.rules.append(f"{name}[lazy]: /{regex}/ {self(end)}")
        return name

    def until(self, end: str, name: str) -> str:
        """A rule `name`: text up to end; lazy (the shortest) where end is text, as control tokens
        cannot be part of TEXT."""
        if self._pattern and self._pattern.match(end):
            return f"TEXT {self(end)}"
        if (rule := f"{name}[lazy]: TEXT {self(end)}") not in self.rules:
            self.rules.append(rule)
        return name


def control_tokens(vocab, markup: str) -> dict[str, int]:
    """The vocabulary's control tokens that a format's markup is written with, by text."""
    ids = (vocab.token_types == TokenType.CONTROL).nonzero()[0]
    return {vocab.tokens[i]: int(i) for i in ids if len(vocab.tokens[i]) > 1 and vocab.tokens[i] in markup}


def pattern_regex(pattern: str) -> str:
    """A JSON schema's pattern as the body of a Lark /regex/ that the whole string must match: a
    '/' escaped, and an unanchored pattern allowed anywhere in it (as JSON schema reads it)."""
    out, escaped = [], False
    for c in pattern:
        out.append("\\/" if c == "/" and not escaped else c)
        escaped = c == "\\" and not escaped
    body = "".join(out)
    start = body.startswith("^")
    body = body[1:] if start else body
    end = False
    if body.endswith("$"):  # (an anchor, unless an odd run of backslashes escapes it)
        end = (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0
        body = body[:-1] if end else body
    anywhere = "(.|\\n)*"
    return ("" if start else anywhere) + "(" + body + ")" + ("" if end else anywhere)
