"""A chat's tools (`ggrun chat --tools`): the file that lists them, checked before the model loads;
the format the chat template writes calls in (text/tool_calls.py); the grammar a reply follows
("auto": text, or text and then calls whose arguments follow their schemas); and a reply's text
streamed up to where its calls begin, the calls read back out of it once it is whole."""
from __future__ import annotations

from ..text.chat_template import BUILTIN_TEMPLATES
from ..text.lark import control_tokens
from ..text.reasoning import ANSWER, reasoning_format
from ..text.tool_calls import HeldText, Tool, ToolCall
from ..text.tool_messages import object_arguments, parse_tools, template_tools
from ..text.user_files import read_text
from .constraint import Grammar, GrammarError


def read_tools(path: str) -> list[Tool]:
    """The functions of a tools file, each parameters schema checked as the grammar will use it
    (InputError or GrammarError naming the problem)."""
    tools = parse_tools(read_text(path), path)
    for tool in tools:
        try:
            Grammar.json_schema(tool.parameters)
        except GrammarError as e:
            raise GrammarError(f"{path}: function {tool.name!r}: {e}") from None
    return tools


class ChatTools:
    """What a conversation's template and replies need of its tools (none: the history's calls
    still render, and replies are free)."""

    def __init__(self, tools: list[Tool], template, tokenizer):
        self.tools = tools
        source = BUILTIN_TEMPLATES[template.name] if template.builtin else tokenizer.vocab.chat_template
        self.template_tools = template_tools(source, template)
        self.format, self.own = self.template_tools.format, self.template_tools.own
        self.grammar = self.shown = None
        # (the tools make a system message: described where the template does not show them, or Phi-4-mini's)
        self.makes_system = bool(tools) and (self.format.system_tools or not self.template_tools.presents)
        if tools:
            control = control_tokens(tokenizer.vocab, self.format.markup)
            reasoning = reasoning_format(tokenizer.vocab)
            try:
                self.grammar = Grammar.tool_calls(self.format, tools, "auto", True, control, reasoning)
            except GrammarError as e:
                raise GrammarError(f"--tools: {e}") from None
            # (the reply decoder gives those tokens as text, which the format's parser reads)
            self.shown = {i: text for text, i in control.items()}

    def template_input(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """The messages and variables the template renders (tool_messages.py): a template with a
        tool format of its own gets the tools; one without, their description and the results as
        user turns; the calls go in the replies' text where it does not write them."""
        return self.template_tools.input(object_arguments(messages), self.tools)

    def read(self, answer: str) -> tuple[str, list[ToolCall]]:
        """A reply's content and calls (a reply that holds no valid call is all content)."""
        return self.format.parse(answer, self.tools) if self.tools else (answer, [])

    def stream(self, on_text) -> HeldBack:
        """What a reply's pieces stream through to on_text (which may be None)."""
        return HeldBack(on_text or (lambda piece, part: None), self.format.start if self.tools else "",
                        self.format.lead)


class HeldBack:
    """A reply's pieces passed on to on_text as they stream, but for its calls: the answer from
    where they may begin waits for the whole reply, and goes on only where it holds no valid call
    (text/tool_calls.py's HeldText). Reasoning passes at once."""

    def __init__(self, on_text, start: str, lead: str = ""):
        self.on_text, self.held = on_text, HeldText(start, lead) if start else None

    @property
    def answer(self) -> str:
        return self.held.text if self.held else ""

    def __call__(self, piece: str, part: str) -> None:
        if part != ANSWER or self.held is None:
            self.on_text(piece, part)
        elif released := self.held.push(piece):
            self.on_text(released, ANSWER)

    def finish(self, has_calls: bool) -> None:
        """The reply is whole: what waited goes on, unless it was calls."""
        if self.held is not None and not has_calls and (rest := self.held.rest(False)):
            self.on_text(rest, ANSWER)
