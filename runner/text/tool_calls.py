"""Tool calls as model families write them, read from their chat templates (llama.cpp's
models/templates): which format a template teaches, the grammar that makes a reply one of its
calls (llguidance's Lark, with each tool's parameter schema for the arguments), and the calls
parsed back out of a reply's text.

    fmt = tool_format(template_source)
    lark = fmt.grammar(tools, "auto", parallel=True, control=control_texts)  # text, or calls
    content, calls = fmt.parse(reply_text, tools)   # a reply that is no valid call is all content

In "auto" the reply is free text until a call's opening appears (a lazy rule: llguidance's way of
constraining tool calls inside running text); "required" (or one named tool) allows only calls.
A template with no tool format of its own gets the Hermes format, its tools described in a
system message (`instructions`); so does a template whose format is its own but which never shows
the model its tools (the DeepSeek R1 distills'), in its format's syntax."""
from __future__ import annotations

import json
import re
import secrets
import string
import time
from dataclasses import dataclass

from .lark import TEXT_RULE, WS, Literals, pattern_regex
from .reasoning import REASONING_MARKUP, answer_opening, reasoning_head

CHOICES = ("auto", "none", "required")  # OpenAI's tool_choice, besides one named function
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the JSON schema of its arguments (an object)

    def as_openai(self) -> dict:
        """As OpenAI's API (and so chat templates) write a tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolFormat:
    """One family's way of writing calls: `opening` starts a block of calls, `item(tool)` is one
    call in Lark, `separator` comes between calls and `closing` ends the block."""
    name = ""
    family = ""
    opening = ""
    separator = ""
    closing = ""
    parallel = True        # whether the format can hold more than one call a reply
    id_length = 0          # a call id's length, where the template insists on one (Mistral's: 9)
    extra_markup = ""      # markup the grammar writes besides opening, separator and closing
    lead = ""              # markup a reply's text begins with (Functionary v3.2's recipient, `all\n`)
    system_tools = False   # the tools go in the system message's `tools` (as JSON text), not the template's
    tools_variable = "tools"  # the template variable that gives the model its tools

    def item(self, tool: Tool, lit) -> str:
        raise NotImplementedError

    def item_text(self, name: str, arguments: dict) -> str:
        """One call as the format writes it (between opening, separators and closing)."""
        raise NotImplementedError

    def written(self, calls: list[dict]) -> str:
        """An assistant's calls (as templates get them) in this format, for templates that do not
        write them."""
        items = [self.item_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return self.opening + self.separator.join(items) + self.closing

    def parse_block(self, block: str, tools: dict) -> list[tuple[str, dict]] | None:
        """The (name, arguments) of the calls in a block, which begins with `opening`; None where
        it is no valid block."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------

    @property
    def markup(self) -> str:
        """All the markup text the format writes (its control tokens are rendered as text)."""
        return self.opening + self.separator + self.closing + self.extra_markup + REASONING_MARKUP

    @property
    def start(self) -> str:
        """Text from which a reply's calls begin (a streamed reply is held back from there)."""
        return self.opening

    def grammar(self, tools: list[Tool], choice: str, parallel: bool, control: dict[str, int],
                reasoning: str | None = None, json_options: dict | None = None) -> str:
        """llguidance's Lark grammar of a reply: `choice` is "auto" (text, or text and then calls)
        or "required" (calls only; a named tool is `tools` of that one); `control`: the
        vocabulary's control tokens by text, which the markup must be written with; `reasoning`:
        how the model marks its reasoning (text/reasoning.py's formats), which may come first; json_options: llguidance's settings for the arguments
        (its "x-guidance": whitespace, leniency)."""
        lit = Literals(control, json_options)
        items = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [f"call_{i}: {self.item(tool, lit)}" for i, tool in enumerate(tools)]
        more = f' ({lit(self.separator)} ({items}))*' if parallel and self.parallel else ""
        rules.append(f"calls: ({items}){more} {lit(self.closing)}")
        # (its markup may be control tokens, which TEXT is not)
        head = f"{reasoning_head(reasoning, lit)} {WS} " if reasoning in ("think", "channel") else ""
        return "\n".join(["%llguidance {}", f"start: {head}{self.reply(choice, lit)}", *rules, *lit.rules, TEXT_RULE])

    def reply(self, choice: str, lit) -> str:
        """Lark for a reply after its reasoning, its calls the rule `calls`: calls only where choice
        is "required", else text, or text and then calls."""
        if choice == "required":
            return f"{lit(self.opening)} calls"
        if self.opening:
            return f"(TEXT | {lit.until(self.opening, 'opening')} calls)"
        # (a call is the whole reply: text is what does not begin like one)
        lit.rules.append("PLAIN: /([^{](.|\\n)*)?/")
        return "(PLAIN | calls)"

    def parse(self, text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
        """The reply's content and its calls: the text before the first opening, and the calls
        after it; a reply whose calls do not parse (or name no given tool) is all content."""
        plain = text.removeprefix(self.lead)
        split = self.split(text)
        if split is None:
            return plain, []
        by_name = {t.name: t for t in tools}
        found = self.parse_block(split[1], by_name)
        if not found or any(name not in by_name or not isinstance(args, dict) for name, args in found):
            return plain, []
        return split[0], [ToolCall(self.new_id(), name, _dumps(args)) for name, args in found]

    def split(self, text: str) -> tuple[str, str] | None:
        """A reply's content and the block of its calls (from `start`); None where it holds none."""
        at = text.find(self.start)
        if at < 0 or self.closing.strip() and not text.rstrip().endswith(self.closing.strip()):
            return None  # (no call, or the last is not whole)
        return text[:at].strip(), text[at:]

    def new_id(self) -> str:
        if self.id_length:
            return "".join(secrets.choice(_ALNUM) for _ in range(self.id_length))
        return "call_" + secrets.token_hex(12)

    def variables(self, tools: list[Tool]) -> dict:
        """The template variables that give the tools to a template of this format."""
        return {self.tools_variable: [t.as_openai() for t in tools]} if tools else {}

    def instructions(self, tools: list[Tool]) -> str:
        """A system message's text that teaches the tools, for a template that does not give them:
        each as OpenAI writes it, and a call as the format writes it."""
        example = self.written([{"function": {"name": "<function-name>", "arguments": {"<argument>": "<value>"}}}])
        return (f"# Tools\n\nYou may call one or more functions to assist with the user query. The functions:\n"
                f"{_listed(tools)}\n\nTo call functions, write:\n{example}")

    def held(self) -> HeldText:
        """A reply's text as it streams, held back from where its calls may begin."""
        return HeldText(self.start, self.lead)


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _listed(tools: list[Tool]) -> str:
    return "\n".join(_dumps(t.as_openai()) for t in tools)


def _text(value) -> str:
    """An argument as the tagged formats write it: a string as itself, any other value as JSON."""
    return value if isinstance(value, str) else _dumps(value)


def _json_objects(text: str, pos: int = 0, separators: str = " \t\n;,") -> tuple[list, int]:
    """The JSON values one after another from pos (between them: separators); and where they end."""
    decoder, values = json.JSONDecoder(), []
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text) or text[pos] not in "{[":
            return values, pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return values, pos
        values.append(value)


def _named(value, key: str = "arguments") -> tuple[str, dict] | None:
    """(name, arguments) of a {"name": ..., key: {...}} object (arguments given as JSON text too)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if isinstance(value.get("function"), dict):  # ({"type": "function", "function": {...}})
        value = value["function"]
    args = value.get(key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return value["name"], args


class _JsonCalls(ToolFormat):
    """Formats that write a call as a JSON object, {"name": NAME, KEY: {...arguments}}."""
    key = "arguments"

    def item_text(self, name, arguments):
        return _dumps({"name": name, self.key: arguments})

    def item(self, tool, lit):
        head = _dumps({"name": tool.name})[:-1] + f', "{self.key}": '
        return f"{lit(head)} {lit.json(tool.parameters)} {lit('}')}"


class _JsonList(_JsonCalls):
    """Formats that write a reply's calls as one JSON list between markers (the opening less its "[",
    the closing less its "]")."""

    def parse_block(self, block, tools):
        values, end = _json_objects(block, len(self.start) - 1)
        if len(values) != 1 or not isinstance(values[0], list) or block[end:].strip() != self.closing[1:].strip():
            return None
        found = [_named(v) for v in values[0]]
        return None if None in found else found


class Hermes(_JsonCalls):
    """Hermes 2 Pro and 3, Qwen 2.5, 3 and 3.5, Granite 4, SmolLM3:
    `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block a call."""
    name, family = "hermes", "Hermes / Qwen 2.5-3.5 / Granite 4 / SmolLM3"
    opening, separator, closing = "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"

    @property
    def start(self) -> str:
        return "<tool_call>"

    def parse_block(self, block, tools):
        found = []
        for body in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", block, re.DOTALL):
            values, end = _json_objects(body)
            if len(values) != 1 or end != len(body) or (call := _named(values[0])) is None:
                return None
            found.append(call)
        return found

    def instructions(self, tools):
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_listed(tools)}\n</tools>\n\nFor each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class Llama3(_JsonCalls):
    """Llama 3.1-3.3 with custom tools: the reply is `{"name": NAME, "parameters": {...}}`, one
    call (the templates refuse more)."""
    name, family = "llama3", "Llama 3.1-3.3 JSON"
    parallel, key = False, "parameters"

    @property
    def start(self) -> str:
        return "{"

    def parse_block(self, block, tools):
        values, end = _json_objects(block)
        if len(values) != 1 or block[end:].strip():
            return None
        call = _named(values[0], "parameters")
        return [call] if call else None


class MistralList(_JsonList):
    """Mistral Nemo and 7B v0.3: `[TOOL_CALLS][{"name": NAME, "arguments": {...}}, ...]`."""
    name, family = "mistral", "Mistral [TOOL_CALLS] list"
    opening, separator, closing, id_length = "[TOOL_CALLS][", ", ", "]", 9


class MistralArgs(ToolFormat):
    """Mistral Small 3.2, Devstral, Ministral 3: `[TOOL_CALLS]NAME[ARGS]{...}` for each call."""
    name, family = "mistral-args", "Mistral [TOOL_CALLS]name[ARGS]"
    opening, separator, id_length = "[TOOL_CALLS]", "[TOOL_CALLS]", 9
    extra_markup = "[ARGS][CALL_ID]"

    def item_text(self, name, arguments):
        return f"{name}[ARGS]{_dumps(arguments)}"

    def item(self, tool, lit):
        return f"{lit(tool.name + '[ARGS]')} {lit.json(tool.parameters)}"

    def parse_block(self, block, tools):
        found = _named_values(block.split("[TOOL_CALLS]")[1:], "[ARGS]")
        return found and [(name.split("[CALL_ID]")[0].strip(), args) for name, args in found]


def _named_values(pieces: list[str], between: str) -> list[tuple[str, object]] | None:
    """The (name, value) of pieces that each write NAME, `between`, then one JSON value; None where one does not."""
    found = []
    for piece in pieces:
        name, sep, rest = piece.partition(between)
        values, end = _json_objects(rest)
        if not sep or len(values) != 1 or rest[end:].strip():
            return None
        found.append((name.strip(), values[0]))
    return found


class GraniteList(_JsonList):
    """Granite 3.x: `<|tool_call|>[{"name": NAME, "arguments": {...}}, ...]`."""
    name, family = "granite", "Granite 3 <|tool_call|> list"
    opening, separator, closing = "<|tool_call|>[", ", ", "]"


class Phi4Mini(_JsonList):
    """Phi-4-mini: `<|tool_call|>[{"name": NAME, "arguments": {...}}, ...]<|/tool_call|>`; its
    template takes the tools as JSON text on the system message, between <|tool|> and <|/tool|>."""
    name, family = "phi4-mini", "Phi-4-mini <|tool_call|>[...]<|/tool_call|>"
    opening, separator, closing, system_tools = "<|tool_call|>[", ", ", "]<|/tool_call|>", True


class NemotronList(_JsonList):
    """Nemotron Nano v2: `<TOOLCALL>[{"name": NAME, "arguments": {...}}, ...]</TOOLCALL>`."""
    name, family = "nemotron", "Nemotron Nano v2 <TOOLCALL>[...]</TOOLCALL>"
    opening, separator, closing = "<TOOLCALL>[", ", ", "]</TOOLCALL>"


class AprielList(_JsonList):
    """Apriel 1.5 and 1.6: `<tool_calls>[{"name": NAME, "arguments": {...}}, ...]</tool_calls>` after
    any text (its reasoning, which ends at `[BEGIN FINAL RESPONSE]`, is text: no format of reasoning.py's)."""
    name, family = "apriel", "Apriel 1.5-1.6 <tool_calls>[...]</tool_calls>"
    opening, separator, closing = "<tool_calls>[", ", ", "]</tool_calls>"


class FireFunction(_JsonList):
    """FireFunction v2: `functools[{"name": NAME, "arguments": {...}}, ...]` after any text; its
    template takes the tools as JSON text in `functions`, and today's date in `datetime`."""
    name, family = "firefunction", "FireFunction v2 functools[...]"
    opening, separator, closing, tools_variable = "functools[", ", ", "]", "functions"

    def variables(self, tools):
        # (as llama.cpp gives templates the date; the template fails without both, tools or none)
        listed = json.dumps([t.as_openai()["function"] for t in tools], ensure_ascii=False, indent=4)
        return {"functions": listed, "datetime": time.strftime("%b %d %Y")}


class _Tagged(ToolFormat):
    """Formats that write each argument in tags of its own: a string's value as its text, any
    other as JSON; `pair` is the text before a key and between it and its value, `value_end`
    the text after a value."""
    pair = ("", "")
    value_end = ""

    def arguments(self, tool: Tool, lit) -> str:
        """Lark for the arguments: the required ones, then each optional one or not, in the schema's order."""
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or ())
        pieces = []
        for key, schema in props.items():
            schema = _resolved(schema, tool.parameters)
            value = _string_value(schema, lit, self.value_end) if schema.get("type") == "string" else \
                f"{_json_value(schema, lit, tool.parameters)} {lit(self.value_end)}"
            pair = f"({lit(self.pair[0] + key + self.pair[1])} {value})"
            pieces.append(pair if key in required else pair + "?")
        return " ".join(pieces)

    def typed(self, tool: Tool, pairs: list[tuple[str, str]]) -> dict:
        """The arguments from their (key, text) pairs, typed as the schema says."""
        props = tool.parameters.get("properties") or {}
        args = {}
        for key, value in pairs:
            if (props.get(key) or {}).get("type") == "string":
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                args[key] = value
        return args


def _json_value(schema, lit, root: dict) -> str:
    """Lark for a JSON value the property's schema validates; root: the tool's parameters, whose
    definitions (which a $ref points into) go along with it."""
    defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
    return lit.json({**_resolved(schema, root), **defs})


def _resolved(schema, root: dict) -> dict:
    """A property's schema, a local $ref ("#/$defs/NAME") followed into the root's definitions."""
    schema = schema if isinstance(schema, dict) else {}  # (true: any value)
    for _ in range(32):  # (a chain of references, never a cycle)
        ref = schema.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, (dict, bool)):  # (true: any value)
            schema = {**(target if isinstance(target, dict) else {}), **{k: v for k, v in schema.items() if k != "$ref"}}
        else:
            raise ValueError(f"the $ref {ref!r} points to no definition")  # noqa: TRY004 (a request's mistake: a 400)
    raise ValueError("a $ref chain too long (or a cycle)")


def _string_value(schema: dict, lit, end: str) -> str:
    """Lark for a string argument written as its text, then the text `end`: one of its enum (or its
    const), its pattern, or its bounded length; any text without them."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not values or not all(isinstance(v, str) for v in values):
            raise ValueError(f"a string's enum must list strings, not {values!r}")
        return f"({' | '.join(lit(v) for v in values)}) {lit(end)}"
    if "format" in schema or ("pattern" in schema and ({"minLength", "maxLength"} & set(schema))):
        raise ValueError("a string argument written as text cannot be held to a format, or to a pattern and "
                         "a length together")
    if "pattern" in schema:
        return lit.ending(pattern_regex(str(schema["pattern"])), end)
    if "minLength" in schema or "maxLength" in schema:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return lit.ending(f"(.|\\n){{{low},{'' if high is None else int(high)}}}", end)
    return lit.until(end, "value_text")


class Glm(_Tagged):
    """GLM 4.5-4.7: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`."""
    name, family = "glm", "GLM-4.5+ <arg_key>/<arg_value>"
    opening, separator, closing = "<tool_call>", "\n</tool_call>\n<tool_call>", "\n</tool_call>"
    pair, value_end = ("\n<arg_key>", "</arg_key>\n<arg_value>"), "</arg_value>"
    extra_markup = "<arg_key></arg_key><arg_value></arg_value>"

    def item_text(self, name, arguments):
        return name + "".join(f"{self.pair[0]}{k}{self.pair[1]}{_text(v)}{self.value_end}" for k, v in arguments.items())

    def item(self, tool, lit):
        return f"{lit(tool.name)} {self.arguments(tool, lit)}"

    def parse_block(self, block, tools):
        found = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", block, re.DOTALL):
            name, _, rest = body.partition("<arg_key>")
            tool = tools.get(name.strip())
            if tool is None:
                return None
            pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "<arg_key>" + rest,
                               re.DOTALL)
            found.append((tool.name, self.typed(tool, pairs)))
        return found


class QwenXml(_Tagged):
    """Qwen3-Coder and Qwen 3.5: `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n...
    </function>\n</tool_call>`."""
    name, family = "qwen-xml", "Qwen3-Coder / Qwen 3.5 <function=...>"
    opening, closing = "<tool_call>\n<function=", "\n</tool_call>"
    separator = "\n</tool_call>\n<tool_call>\n<function="
    pair, value_end = ("<parameter=", ">\n"), "\n</parameter>\n"
    extra_markup = "</function></parameter>"
    value_pattern = r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>"  # (the newlines around a value are markup)

    @property
    def start(self) -> str:
        return "<tool_call>"

    def item_text(self, name, arguments):
        pairs = "".join(f"{self.pair[0]}{k}{self.pair[1]}{_text(v)}{self.value_end}" for k, v in arguments.items())
        return f"{name}>\n{pairs}</function>"

    def item(self, tool, lit):
        return f"{lit(tool.name + '>' + chr(10))} {self.arguments(tool, lit)} {lit('</function>')}"

    def parse_block(self, block, tools):
        found = []
        for name, body in re.findall(r"<function=([^>\n]*)>(.*?)</function>", block, re.DOTALL):
            tool = tools.get(name.strip())
            if tool is None:
                return None
            pairs = re.findall(self.value_pattern, body, re.DOTALL)
            found.append((tool.name, self.typed(tool, pairs)))
        return found or None


class SeedXml(QwenXml):
    """Seed-OSS: `<seed:tool_call>\n<function=NAME>\n<parameter=K>V</parameter>\n...</function>\n</seed:tool_call>`."""
    name, family = "seed-xml", "Seed-OSS <seed:tool_call>"
    opening, closing = "<seed:tool_call>\n<function=", "\n</seed:tool_call>"
    separator = "\n</seed:tool_call>\n<seed:tool_call>\n<function="
    pair, value_end = ("<parameter=", ">"), "</parameter>\n"
    value_pattern = r"<parameter=([^>\n]*)>(.*?)</parameter>"

    @property
    def start(self) -> str:
        return "<seed:tool_call>"


class FunctionTag(ToolFormat):
    """Functionary v3.1 (Llama 3.1): `<function=NAME>{...}</function>`, one call."""
    name, family = "function-tag", "Functionary v3.1 <function=NAME>{...}"
    opening, parallel = "<function=", False
    extra_markup = "</function>"

    def item_text(self, name, arguments):
        return f"{name}>{_dumps(arguments)}</function>"

    def item(self, tool, lit):
        return f"{lit(tool.name + '>')} {lit.json(tool.parameters)} {lit('</function>')}"

    def parse_block(self, block, tools):
        m = re.fullmatch(r"<function=([^>\n]*)>(.*)</function>\s*", block, re.DOTALL)
        values, end = _json_objects(m.group(2)) if m else ([], 0)
        if m is None or len(values) != 1 or m.group(2)[end:].strip():
            return None
        return [(m.group(1).strip(), values[0])]


class FunctionaryV32(ToolFormat):
    """Functionary v3.2: a reply is messages, each `>>>RECIPIENT\nTEXT`, its first `>>>` in the
    generation prompt: `all\n` and text for the user, then a call for each function, `NAME\n{...}`."""
    name, family = "functionary-v3.2", "Functionary v3.2 >>>NAME\n{...}"
    separator, lead = ">>>", "all\n"

    @property
    def start(self) -> str:
        return self.separator

    def item_text(self, name, arguments):
        return f"{name}\n{_dumps(arguments)}"

    def item(self, tool, lit):
        return f"{lit(tool.name + chr(10))} {lit.json(tool.parameters)}"

    def reply(self, choice, lit):
        text = f"{lit(self.lead)} {lit.until(self.separator, 'opening')}"
        if choice == "required":
            return f"({text})? calls"
        return f"({lit(self.lead)} TEXT | ({text})? calls)"

    def split(self, text):
        text = text.lstrip()  # (after any reasoning)
        if not text.startswith(self.lead):
            return "", text
        content, sep, block = text[len(self.lead):].partition(self.separator)
        return (content.strip(), block) if sep else None

    def parse_block(self, block, tools):
        return _named_values(block.split(self.separator), "\n")


class DeepSeekR1(ToolFormat):
    """DeepSeek R1 (its distilled Llama and Qwen models): `<｜tool▁calls▁begin｜>`, each call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>` (a newline
    between), then `<｜tool▁calls▁end｜>`."""
    name, family = "deepseek-r1", "DeepSeek R1 <｜tool▁calls▁begin｜>"
    opening = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    separator = "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    closing = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"

    @property
    def start(self) -> str:
        return "<｜tool▁calls▁begin｜>"

    def item_text(self, name, arguments):
        return f"{name}\n```json\n{_dumps(arguments)}"

    def item(self, tool, lit):
        return f"{lit(tool.name + chr(10) + '```json' + chr(10))} {lit.json(tool.parameters)}"

    def parse_block(self, block, tools):
        pieces = re.findall(r"<｜tool▁call▁begin｜>[^<]*<｜tool▁sep｜>(.*?)\n```\s*<｜tool▁call▁end｜>", block,
                            re.DOTALL)
        return _named_values(pieces, "\n```json")


_QUOTE = '<|"|>'  # (Gemma 4's string quote)


class Gemma4(ToolFormat):
    """Gemma 4: `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, its keys bare and in sorted
    order, a string between <|"|> quotes, other values as JSON writes them."""
    name, family = "gemma4", "Gemma 4 <|tool_call>call:NAME{...}"
    opening, separator, closing = "<|tool_call>call:", "<tool_call|><|tool_call>call:", "<tool_call|>"
    extra_markup = _QUOTE

    def item_text(self, name, arguments):
        return name + _gemma_written(arguments)

    def item(self, tool, lit):
        return f"{lit(tool.name)} {_gemma_value(tool.parameters, lit, tool.parameters)}"

    def parse_block(self, block, tools):
        found, pos = [], 0
        while block.startswith(self.opening, pos):
            m = re.match(r"[A-Za-z0-9_.-]+", block[pos + len(self.opening):])
            if m is None:
                return None
            pos += len(self.opening) + m.end()
            end = block.find(self.closing, pos)
            arguments = _gemma_read(block[pos:end]) if end >= 0 else None
            if not isinstance(arguments, dict):
                return None
            found.append((m.group(), arguments))
            pos = end + len(self.closing)
        return found if not block[pos:].strip() else None


def _gemma_written(value) -> str:
    """A value as Gemma 4's template writes a call's arguments (format_argument, keys bare)."""
    if isinstance(value, str):
        return _QUOTE + value + _QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma_written(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_gemma_written, value)) + "]"
    return _dumps(value)


def _as_json(text: str, tokens: re.Pattern, written):
    """Text in a call syntax that differs from JSON by some tokens, read as JSON: each match of
    `tokens` replaced by written(match), the rest as it is; None where that is no JSON."""
    out, pos = [], 0
    try:
        while pos < len(text):
            m = tokens.match(text, pos)
            out.append(written(m) if m else text[pos])
            pos = m.end() if m else pos + 1
        return json.loads("".join(out))
    except (ValueError, RecursionError):  # (a JSONDecodeError too)
        return None


# Gemma 4's strings between quotes, and its bare keys (only a key is followed by ':')
_GEMMA_TOKENS = re.compile(r'<\|"\|>(.*?)<\|"\|>|([^\s{}\[\],:<]+)\s*:', re.DOTALL)


def _gemma_read(text: str):
    """A value in Gemma 4's call syntax, read as JSON (None where it is not one)."""
    return _as_json(text, _GEMMA_TOKENS, lambda m: _dumps(m[1]) if m[1] is not None else _dumps(m[2]) + ":")


def _gemma_value(schema, lit, root: dict) -> str:
    """Lark for a value of the schema in Gemma 4's call syntax: objects (keys in sorted order, the
    optional ones may be left out), arrays, strings between quotes (an enum's, a pattern's, or any
    text), and what JSON writes alike (numbers, booleans, null). root: the tool's parameters, whose
    definitions a $ref points into."""
    schema = _resolved(schema, root)
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = sorted((schema.get("properties") or {}).items())
        members = _members(props, set(schema.get("required") or ()), lit, lambda s: _gemma_value(s, lit, root))
        return f"{lit('{')} {members} {lit('}')}"
    if kind == "array":
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) <= 0:
            return f"{lit('[')} {lit(']')}"
        item = _gemma_value(schema.get("items", {"type": "string"}), lit, root)
        more = f"({lit(',')} {item}){{{max(low - 1, 0)},{'' if high is None else int(high) - 1}}}"
        listed = f"{item} {more}"
        return f"{lit('[')} {listed if low else f'({listed})?'} {lit(']')}"
    if kind == "string" or "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return f"{lit(_QUOTE)} {_string_value(schema, lit, _QUOTE)}"
    if kind in ("integer", "number", "boolean", "null"):
        return lit.json(schema)
    raise ValueError(f"a parameter of type {kind!r} (or without one) cannot be written in Gemma 4's call syntax")


def _members(props: list, required: set, lit, value, pair: str = ":", comma: str = ",") -> str:
    """Lark for an object's members (Gemma 4's, or LFM2's keyword arguments) in order, each KEY,
    `pair`, then value(its schema), `comma` before each but the first written: a rule for each
    member and whether one came before it, so that each is written once."""
    names: dict[tuple[int, bool], str] = {}

    def rest(i: int, after: bool) -> str:
        if i == len(props):
            return ""
        if (i, after) not in names:
            names[i, after] = name = lit.fresh("members")
            key, schema = props[i]
            member = f"{lit((comma if after else '') + key + pair)} {value(schema)} {rest(i + 1, True)}"
            skipped = rest(i + 1, after)
            body = member if key in required else f"{member} | {skipped}" if skipped else f"({member})?"
            lit.rules.append(f"{name}: {body}")
        return names[i, after]
    return rest(0, False)


class Lfm2(ToolFormat):
    """LFM2 and LFM2.5: `<|tool_call_start|>[NAME(key=VALUE, ...), ...]<|tool_call_end|>`, Python-style
    calls whose values Python or JSON may write (a string in either quote, True or true). The grammar
    writes each value as JSON, held to its parameter's schema."""
    name, family = "lfm2", "LFM2 <|tool_call_start|>[name(key=value)]"
    opening, separator, closing = "<|tool_call_start|>[", ", ", "]<|tool_call_end|>"

    def item_text(self, name, arguments):
        return f"{name}({', '.join(f'{k}={_dumps(v)}' for k, v in arguments.items())})"

    def item(self, tool, lit):
        props = list((tool.parameters.get("properties") or {}).items())
        if bad := next((k for k, _ in props if not k.isidentifier()), None):
            raise ValueError(f"a parameter named {bad!r} cannot be written as a Python keyword argument")
        members = _members(props, set(tool.parameters.get("required") or ()), lit,
                           lambda s: _json_value(s, lit, tool.parameters), "=", ", ")
        return f"{lit(tool.name + '(')} {members} {lit(')')}"

    def parse_block(self, block, tools):
        calls = _as_json(block[len(self.opening) - 1:block.rindex("]") + 1], _PYTHON_TOKENS, _python_json)
        found = [_named(c) for c in calls] if isinstance(calls, list) else [None]
        return None if None in found else found


# a Python-style call's strings (either quote), its name and its keywords, Python's constants, its end
_PYTHON_TOKENS = re.compile(r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|([\w.-]+)\s*([(=])|(True|False|None)\b|\)""")


def _python_json(m: re.Match) -> str:
    """A token of Python-style calls as JSON: a call as {"name": NAME, "arguments": {...}}."""
    quoted, word, mark, constant = m.groups()
    if quoted:  # (a single-quoted string: its quotes swapped, as JSON escapes the rest alike)
        body = quoted[1:-1] if quoted[0] == '"' else quoted[1:-1].replace("\\'", "'").replace('"', '\\"')
        return _dumps(json.loads(f'"{body}"'))
    if word:
        return f'{_dumps(word)}:' if mark == "=" else f'{{"name": {_dumps(word)}, "arguments": {{'
    return {"True": "true", "False": "false", "None": "null"}.get(constant, "}}")


class Harmony(ToolFormat):
    """gpt-oss (harmony): a call is a commentary message to `functions.NAME`,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, which ends the
    reply (`<|call|>`); its reasoning (the analysis channel) may come first. The reply decoder
    (reasoning.py) gives a call as `to=functions.NAME<|message|>{...}`."""
    name, family, parallel = "harmony", "gpt-oss harmony", False
    opening = "to=functions."
    extra_markup = "<|channel|><|message|><|constrain|><|end|><|start|><|call|>"

    def item_text(self, name, arguments):
        return f"{name} <|constrain|>json<|message|>{_dumps(arguments)}"

    def item(self, tool, lit):
        return f"{lit(tool.name + ' <|constrain|>json<|message|>')} {lit.json(tool.parameters)}"

    def grammar(self, tools, choice, parallel, control, reasoning=None, json_options=None):
        return super().grammar(tools, choice, parallel, control, None, json_options)  # (its reasoning: its own head)

    def reply(self, choice, lit):
        call = f"{lit('<|channel|>commentary ' + self.opening)} calls"
        final = f"{lit(answer_opening('harmony'))} TEXT"
        return f"{reasoning_head('harmony', lit)} ({call if choice == 'required' else f'{call} | {final}'})"

    def parse(self, text, tools):
        m = re.search(r"to=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>\s*\w+)?\s*<\|message\|>(.*?)"
                      r"(?:<\|call\|>|<\|end\|>|$)", text, re.DOTALL)
        if m is None:
            return _harmony_content(text), []
        values, end = _json_objects(m.group(2))
        tool = {t.name: t for t in tools}.get(m.group(1))
        if len(values) != 1 or not isinstance(values[0], dict) or m.group(2)[end:].strip() or tool is None:
            return _harmony_content(text), []
        content = _harmony_content(text[:m.start()])
        return content, [ToolCall(self.new_id(), tool.name, json.dumps(values[0], ensure_ascii=False))]


def _harmony_content(text: str) -> str:
    """A harmony reply's answer where its markup is plain text (a vocabulary without the harmony
    tokens): what the last message says."""
    return text.rsplit("<|message|>", 1)[-1].replace("<|end|>", "").strip() if "<|message|>" in text else text


# the formats, by what gives them away in a template's text (the first that matches)
FORMATS: tuple[tuple[str, type[ToolFormat]], ...] = (
    ("<|channel|>", Harmony),
    (">>>all", FunctionaryV32),
    ("List of tools: ", Lfm2),
    ("<TOOLCALL>", NemotronList),
    ("functools[", FireFunction),
    ("'```json'", DeepSeekR1),  # (its calls' fence in the template's code: Command R and Kimi K3 write one in text)
    ("<|tool_call>call:", Gemma4),
    ("[ARGS]", MistralArgs),
    ("[TOOL_CALLS]", MistralList),
    ("<arg_key>", Glm),
    ("<seed:tool_call>", SeedXml),
    ("<parameter=", QwenXml),
    ("<function=", FunctionTag),
    ("<|/tool|>", Phi4Mini),
    ("<|tool_call|>", GraniteList),
    ("<tool_calls>[", AprielList),  # (before Hermes: Apriel 1.5's instructions name <tool_call> tags)
    ("<tool_call>", Hermes),
    ('"parameters": ', Llama3),
)


def writes_calls(template_source: str) -> bool:
    """Whether a template writes an assistant message's tool calls (else they go in its text)."""
    return "tool_calls" in template_source


def tool_format(template_source: str) -> tuple[ToolFormat, bool]:
    """The format a chat template teaches, and whether it is its own (False: none is; Hermes, its
    tools described by `instructions`)."""
    for clue, fmt in FORMATS:
        if clue in template_source:
            return fmt(), True
    return Hermes(), False


def presents_tools(template_source: str, fmt: ToolFormat) -> bool:
    """Whether a template gives the model its tools (reads the format's variable for them): the
    DeepSeek R1 distills' templates write calls but never show the tools."""
    return re.search(rf"\b{fmt.tools_variable}\b", template_source) is not None


class HeldText:
    """A reply's answer as it streams, released up to where its calls may begin (`start`, or an
    end that may grow into it); the rest waits for the whole reply."""

    def __init__(self, start: str, lead: str = ""):
        self.start, self.lead = start, lead  # lead: markup the answer's text begins with (else it is all calls)
        self.text, self.sent = "", 0  # the answer so far; how much of it is released

    def push(self, piece: str) -> str:
        """What can be released now that piece follows."""
        self.text += piece
        if not self.text.startswith(self.lead):
            return ""
        self.sent = max(self.sent, len(self.lead))
        at = self.text.find(self.start)
        if at < 0:
            at = len(self.text) - next((n for n in range(min(len(self.start) - 1, len(self.text)), 0, -1)
                                        if self.text.endswith(self.start[:n])), 0)
        released, self.sent = self.text[self.sent:max(at, self.sent)], max(at, self.sent)
        return released

    def rest(self, has_calls: bool) -> str:
        """What was held back, once the reply is whole: where it holds calls, the content before them."""
        if not has_calls:
            return self.text[self.sent:]
        if not self.text.startswith(self.lead):
            return ""
        return self.text[self.sent:max(self.text.find(self.start), self.sent)].rstrip()
