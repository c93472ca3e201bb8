"""Structured output as requests ask for it, made into one Grammar (runner/engine/constraint.py)
before the job is queued: OpenAI's response_format (text, json_object, json_schema), llama-server's
`grammar` (GBNF) and `json_schema` fields, Ollama's `format` ("json" or a schema). A malformed
field, an invalid schema or grammar, and a schema that cannot be enforced are 400s naming the
field and the problem; a request sets one constraint at most."""
from __future__ import annotations

from ..engine.constraint import Grammar, GrammarError
from .fields import Fields, bad, shown

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
ANY_OBJECT = {"type": "object"}  # (an empty schema, and json_object: any object, as llama-server takes them)


def openai_grammar(f: Fields, response_format: bool = True) -> Grammar | None:
    """The grammar of an OpenAI-style request: llama-server's `grammar` or `json_schema`, or (where
    the endpoint takes it: chat) OpenAI's `response_format`; None where none constrains it."""
    given = {}
    if f.get("grammar", "string"):
        given["grammar"] = lambda: _made(Grammar.gbnf, f.data["grammar"], None)  # (its errors say "grammar")
    if f.data.get("json_schema") is not None:
        given["json_schema"] = lambda: schema_grammar(f.data["json_schema"], "json_schema")
    if response_format and (made := _response_format(f.get("response_format", "object"))) is not None:
        given["response_format"] = made
    if len(given) > 1:
        first, second = list(given)[:2]
        raise bad(f"{first} and {second} cannot both be set: a request takes one grammar or schema")
    return next(iter(given.values()))() if given else None


def _response_format(value: dict | None):
    """What makes response_format's grammar (None for text, or none given)."""
    if value is None:
        return None
    kind = Fields(value, ("type", "json_schema", "schema"), "response_format.").require("type", "string")
    if kind not in RESPONSE_FORMATS:
        raise bad(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, not {kind!r}")
    known = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}[kind]
    f = Fields(value, known, "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":  # (llama-server's extension: a schema beside json_object)
        return lambda: schema_grammar(f.data.get("schema", ANY_OBJECT), "response_format.schema")
    inner = Fields(f.require("json_schema", "object"), ("name", "description", "schema", "strict"),
                   "response_format.json_schema.")
    inner.get("name", "string")
    inner.get("description", "string")
    inner.get("strict", "boolean")  # (ggrun enforces every schema strictly, or refuses it)
    schema = inner.data.get("schema")
    return lambda: schema_grammar(ANY_OBJECT if schema is None else schema, "response_format.json_schema.schema")


def ollama_grammar(value) -> Grammar | None:
    """Ollama's `format`: "json" (any object) or a JSON schema; None for none."""
    if value is None or value == "":
        return None
    if value == "json":
        return schema_grammar(ANY_OBJECT, "format")
    if isinstance(value, dict):
        return schema_grammar(value, "format")
    raise bad(f"format must be \"json\" or a JSON schema (an object), not {shown(value)}")


def schema_grammar(schema, where: str) -> Grammar:
    """A JSON schema given in a request (an object, or true or false; an empty one: any object)."""
    if not isinstance(schema, (dict, bool)):
        raise bad(f"{where} must be a JSON schema (an object), not {shown(schema)}")
    return _made(Grammar.json_schema, ANY_OBJECT if schema == {} else schema, where)


def _made(make, value, where: str | None) -> Grammar:
    try:
        return make(value)
    except GrammarError as e:
        raise bad(f"{where}: {e}" if where else str(e)) from None
