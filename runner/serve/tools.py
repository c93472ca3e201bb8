"""Tool calls in a chat request: OpenAI's tools, tool_choice and parallel_tool_calls (Ollama's
tools alike) read and checked before the job is queued, the grammar that keeps the reply in the
model's tool-call format (text/tool_calls.py), and the calls read back out of the reply, whole or
as it streams. A reply that is no valid call stays text: never an error."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.constraint import Grammar, GrammarError
from ..text.tool_calls import CHOICES, Tool, ToolCall, ToolFormat
from ..text.tool_messages import NAME, NO_PARAMETERS
from .fields import Fields, bad, check_type, shown


@dataclass
class ToolUse:
    """A request's tools, as the model is to use them."""
    tools: list[Tool]
    choice: str              # "auto" or "required" (a named function: `tools` is that one)
    parallel: bool
    format: ToolFormat
    shown: dict[int, str]    # the format's control tokens, given as text to the parser
    grammar: Grammar


def read_tools(f: Fields, model) -> ToolUse | None:
    """The request's tools, tool_choice and parallel_tool_calls (None: no tool may be called);
    400s naming a malformed tool, an invalid parameters schema, or an unknown tool_choice."""
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(f.get("tools", "array") or [])]
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise bad(f"tools: the function name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    choice = _choice(f.data.get("tool_choice"), tools)
    parallel = f.get("parallel_tool_calls", "boolean", True)
    if choice == "none" or not tools:
        return None
    if isinstance(choice, Tool):
        tools, choice = [choice], "required"
    try:
        grammar = Grammar.tool_calls(model.tool_format, tools, choice, parallel, model.tool_control, model.reasoning)
    except GrammarError as e:
        raise bad(f"tools: {e}") from None
    return ToolUse(tools, choice, parallel, model.tool_format, {i: t for t, i in model.tool_control.items()}, grammar)


def _tool(value, where: str) -> Tool:
    f = Fields(check_type(where, value, "object"), ("type", "function"), f"{where}.")
    if f.get("type", "string", "function") != "function":
        raise bad(f"{where}.type must be \"function\", not {shown(f.data['type'])}")
    fn = Fields(f.require("function", "object"), ("name", "description", "parameters", "strict"), f"{where}.function.")
    name = fn.require("name", "string")
    if not NAME.fullmatch(name):
        raise bad(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, not {name!r}")
    fn.get("strict", "boolean")  # (every schema is enforced strictly, or refused)
    parameters = fn.get("parameters", "object") or NO_PARAMETERS
    try:
        Grammar.json_schema(parameters)
    except GrammarError as e:
        raise bad(f"{where}.function.parameters: {e}") from None
    return Tool(name, fn.get("description", "string", ""), parameters)


def _choice(value, tools: list[Tool]) -> str | Tool:
    """tool_choice: "auto" (the default with tools), "none", "required", or a named function."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad(f"tool_choice must be one of {', '.join(CHOICES)} or a function, not {value!r}")
        if value == "required" and not tools:
            raise bad("tool_choice is \"required\" but no tools are given")
        return value
    f = Fields(check_type("tool_choice", value, "object"), ("type", "function"), "tool_choice.")
    name = Fields(f.require("function", "object"), ("name",), "tool_choice.function.").require("name", "string")
    named = next((t for t in tools if t.name == name), None)
    if named is None:
        raise bad(f"tool_choice names the function {name!r}, which is not among the tools")
    return named


class CallStream:
    """A streamed reply's answer, released as content up to where a call may begin; the calls
    (and any content held back) once the reply is whole."""

    def __init__(self, use: ToolUse):
        self.use, self.held = use, use.format.held()

    def push(self, piece: str) -> str:
        """The content that can go out now that piece follows."""
        return self.held.push(piece)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet sent, and the calls."""
        _, calls = self.use.format.parse(self.held.text, self.use.tools)
        return self.held.rest(bool(calls)), calls
