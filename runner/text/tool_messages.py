"""The functions a user gives `ggrun chat --tools` (a JSON list, in OpenAI's shape or bare), and a
conversation with tool calls as a chat template takes it: the calls' arguments as objects (as
transformers passes them, or as JSON text to a template that takes no object), written into the
reply's text where the template does not write them; for a template with no tool format, the tools
described in the system message and the results as a user turn of <tool_response> blocks, as Qwen
2.5's template writes them."""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

from .chat_template import ChatTemplateError
from .tool_calls import Tool, ToolFormat, presents_tools, tool_format, writes_calls
from .user_files import InputError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (OpenAI's rule for a function's name)
NO_PARAMETERS = {"type": "object", "properties": {}}


def parse_tools(text: str, where: str) -> list[Tool]:
    """The functions listed in a tools file's text (InputError naming the first problem):
    [{"type": "function", "function": {"name", "description", "parameters"}}, ...], or the bare
    {"name", "description", "parameters"} objects."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{where} is not JSON: {e}") from None
    except RecursionError:
        raise InputError(f"{where} is nested too deeply") from None
    if not isinstance(data, list) or not data:
        raise InputError(f"{where} must be a JSON list of one or more functions")
    tools = [_tool(item, f"{where}: function {i + 1}") for i, item in enumerate(data)]
    twice = [name for name, n in Counter(t.name for t in tools).items() if n > 1]
    if twice:
        raise InputError(f"{where}: two functions are named {twice[0]!r}")
    return tools


def _tool(item, where: str) -> Tool:
    if isinstance(item, dict) and item.get("type") == "function":
        item = item.get("function")
    if not isinstance(item, dict):
        raise InputError(f"{where} is not an object with a name, a description and parameters")
    name = item.get("name")
    if name is None:
        raise InputError(f"{where} has no name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InputError(f"{where}: the name {name!r} is not 1 to 64 letters, digits, '_' or '-'")
    description = item.get("description", "")
    if not isinstance(description, str):
        raise InputError(f"{where} ({name}): the description is not a string")
    parameters = item.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InputError(f"{where} ({name}): parameters must be the JSON schema of an object")
    return Tool(name, description, parameters)


def object_arguments(messages: list[dict]) -> list[dict]:
    """The messages with each call's arguments as an object, not JSON text: templates write them
    with `tojson` (Qwen, Hermes, Llama 3.x, gpt-oss), and so does ToolFormat.written."""
    return _arguments_as(messages, json.loads)


def _arguments_as(messages: list[dict], convert) -> list[dict]:
    """The messages with convert(arguments) for each call's arguments."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": convert(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


@dataclass(frozen=True)
class TemplateTools:
    """How a chat template takes a conversation's tools, calls and results (read once from it)."""
    format: ToolFormat    # the format its calls follow
    own: bool             # the format is the template's own (else Hermes, see `described`)
    presents: bool        # it gives the model the tools (else the format's `instructions` go in a system message)
    writes: bool          # it writes an assistant's calls (else they go in the reply's text)
    text_arguments: bool  # it takes a call's arguments as JSON text, not as an object

    def input(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], dict]:
        """The messages (calls' arguments as objects) and the variables the template renders for
        a conversation with tools (or none): the calls written into the replies' text where it does
        not write them; the tools in the system message where the format keeps them there
        (Phi-4-mini), as the template's variable where it shows them, else described."""
        fmt = self.format
        messages = calls_written(messages, fmt) if not self.writes else \
            _arguments_as(messages, lambda a: json.dumps(a, ensure_ascii=False)) if self.text_arguments else messages
        if fmt.system_tools and tools:
            return with_system_tools(messages, tools), {}
        if self.presents:
            return messages, fmt.variables(tools)
        if not tools:
            return messages, {}
        return (with_instructions(messages, fmt.instructions(tools)) if self.own else
                described(messages, fmt.instructions(tools))), {}


def template_tools(source: str, template) -> TemplateTools:
    """What the chat template (a ChatTemplate, from source) does with tools."""
    fmt, own = tool_format(source)
    return TemplateTools(fmt, own, own and presents_tools(source, fmt), writes_calls(source),
                         _takes_text_arguments(template, fmt))


_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"a": "b"}}}]}]


def _takes_text_arguments(template, fmt: ToolFormat) -> bool:
    """Whether the template fails on a call's arguments as an object, but not as JSON text
    (Functionary v3.2's adds them to a string): llama.cpp tries its templates so too."""
    for probe in (_PROBE, _arguments_as(_PROBE, json.dumps)):
        try:
            template.render(probe, False, **fmt.variables([]))
            return probe is not _PROBE
        except ChatTemplateError:
            pass
    return False


def with_system_tools(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """The tools, as JSON text, on the system message's `tools` (one put first where there is none)."""
    listed = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools],
                        ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": listed}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": listed}, *messages]


def calls_written(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """For a template that does not write an assistant's calls: each written into its text, after
    its content, in the format its replies follow (arguments as objects)."""
    return [{**m, "content": "\n".join(filter(None, (m["content"], fmt.written(m["tool_calls"]))))}
            if m.get("tool_calls") else m for m in messages]


def described(messages: list[dict], instructions: str) -> list[dict]:
    """For a template with no tool format: `instructions` (how to call the tools) after the system
    prompt, and each run of tool results as one user turn of <tool_response> blocks (a template
    may know no `tool` role, or insist that turns alternate)."""
    out, previous = [], None
    for m in messages:
        if m["role"] != "tool":
            out.append(m)
        elif previous == "tool":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n<tool_response>\n{m['content']}\n</tool_response>"}
        else:
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        previous = m["role"]
    return with_instructions(out, instructions)


def with_instructions(messages: list[dict], instructions: str) -> list[dict]:
    """`instructions` (how to call the tools) after the system prompt (a system message put first
    where there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]
