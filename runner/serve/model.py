"""The served model as the API sees it: its names and its file's facts (ModelCard, known before it
loads), and, once loaded, turning a request's messages or prompt into token ids that fit the
context of a sequence (ServedModel)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_io import GGUFFile, read_params

from ..measure.bench import parameter_counts
from ..text.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplateError,
    choose_template,
    render_with_content_spans,
)
from ..text.lark import control_tokens
from ..text.reasoning import reasoning_format
from ..text.tool_messages import template_tools
from .fields import ApiError, bad

# what a template is given besides chat_template_kwargs (a request may not set them)
_TEMPLATE_OWN = {"messages", "add_generation_prompt", "tools", "documents"}


@dataclass
class ModelCard:
    name: str            # the model's id in the API
    aliases: frozenset   # the names a request may also call it by
    path: Path
    created: int         # the file's modification time (Unix seconds)
    architecture: str
    quant: str
    size: int            # bytes, all parts
    parameters: int
    metadata: dict       # the header's scalar fields, but the tokenizer's

    @classmethod
    def of(cls, given: str | None, path: Path, alias: str | None = None) -> ModelCard:
        """The card of the file at path, named alias, else as given (a registry name or a
        hf.co name), else by its file name."""
        f = GGUFFile(path)
        name = alias or (given if given and not Path(given).exists() else path.name)
        aliases = {name, path.name, path.stem, str(path)} | ({given} if given else set())
        metadata = {k: m.value for k, m in f.metadata.items()
                    if isinstance(m.value, (str, int, float, bool)) and not k.startswith("tokenizer.")}
        return cls(name, frozenset(aliases | {a + ":latest" for a in aliases}), path, int(path.stat().st_mtime),
                   f.architecture, f.file_type_name(), f.size, parameter_counts(f, read_params(f))[0], metadata)

    def check(self, requested: str | None) -> None:
        """A request's `model`: this one's name (or one of its aliases), or none given."""
        if requested is not None and requested not in self.aliases:
            raise ApiError(404, f"model {requested!r} not found: this server serves {self.name!r}",
                           "not_found_error")

    @property
    def parameter_size(self) -> str:
        n = self.parameters
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


class ServedModel:
    """What the handlers use of the loaded model: its tokenizer and chat template, and the context
    of each sequence."""

    def __init__(self, lm, n_ctx: int):
        self.tokenizer, self.n_ctx = lm.tokenizer, n_ctx
        self.template, self.template_warning = choose_template(lm.tokenizer.vocab)
        self.reasoning = reasoning_format(lm.tokenizer.vocab)  # how replies mark their reasoning (text/reasoning.py)
        self.template_source = (BUILTIN_TEMPLATES[self.template.name] if self.template.builtin
                                else lm.tokenizer.vocab.chat_template)
        # what the template does with tools (its tool-call format, ...), and the vocabulary's control
        # tokens of the format's markup
        self.template_tools = template_tools(self.template_source, self.template)
        self.tool_format = self.template_tools.format
        self.tool_control = control_tokens(lm.tokenizer.vocab, self.tool_format.markup)

    def chat_ids(self, messages: list[dict], variables: dict | None = None, tools=None) -> list[int]:
        """The tokens of a conversation through the chat template, ready for the reply; only the
        template's markup yields control tokens, never what the messages say. tools: a ToolUse
        (serve/tools.py), its tools given to the template, or described in a system message
        where the template has no tool format."""
        text, spans = self._rendered(messages, variables, tools)
        return self._start(self.tokenizer.encode_rendered(text, literal=spans))

    def chat_prompt(self, messages: list[dict], variables: dict | None = None, tools=None) -> str:
        """The text chat_ids tokenizes (llama-server's /apply-template)."""
        return self._rendered(messages, variables, tools)[0]

    def _rendered(self, messages, variables, tools) -> tuple[str, list[tuple[int, int]]]:
        variables = variables or {}
        reserved = sorted(_TEMPLATE_OWN & set(variables))
        if reserved:
            raise bad(f"chat_template_kwargs may not set {reserved[0]!r}")
        messages, extra = self.template_tools.input(messages, tools.tools if tools is not None else [])
        variables = {**variables, **extra}
        try:
            return render_with_content_spans(self.template, messages, add_generation_prompt=True, **variables)
        except ChatTemplateError as e:
            raise bad(str(e)) from None

    def text_ids(self, prompt: str | list[int], parse_special: bool = True) -> list[int]:
        """A plain prompt's tokens (BOS as the vocabulary asks), or the token ids given."""
        if isinstance(prompt, str):
            return self._start(self.tokenizer.encode(prompt, parse_special=parse_special))
        self.check_ids(prompt)
        return self._start(list(prompt))

    def check_ids(self, ids: list) -> None:
        n = len(self.tokenizer.vocab.tokens)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise bad(f"token {i!r} is not an id of this model's vocabulary (0 to {n - 1})")

    def _start(self, ids: list[int]) -> list[int]:
        """An empty prompt starts from BOS, as llama.cpp's does."""
        if ids:
            return ids
        bos = self.tokenizer.vocab.bos_id
        if bos < 0:
            raise bad("the prompt is empty and the model has no BOS token to start from")
        return [bos]

    def budget(self, n_prompt: int, max_tokens: int | None) -> int:
        """The tokens a reply may have: max_tokens where the prompt and they fit in the context
        of a sequence, else a 400 naming both counts; none given, up to the end of the context."""
        n_ctx = self.n_ctx
        extra = {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
        if max_tokens is None:
            if n_prompt >= n_ctx:
                raise ApiError(400, f"the prompt has {n_prompt} tokens, and the context of a sequence holds "
                                    f"{n_ctx} (-c): no room is left for a reply", "exceed_context_size_error", **extra)
            return n_ctx - n_prompt
        if n_prompt + max_tokens > n_ctx:
            raise ApiError(400, f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: together they "
                                f"exceed the context of a sequence, {n_ctx} tokens (-c)", "exceed_context_size_error",
                           **extra)
        return max_tokens

