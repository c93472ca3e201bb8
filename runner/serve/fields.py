"""A request's JSON, checked: ApiError (a client's mistake, answered in OpenAI's error shape), the
body as an object of known fields read by type, and the sampling options it sets (checked by
SamplingOptions, as the command line's are)."""
from __future__ import annotations

import dataclasses
import json

from ..engine.sampler import OptionError, SamplingOptions

# the error types of OpenAI's API (and llama-server's) by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "unavailable_error"}
MAX_BODY = 64 << 20  # bytes of a request body


class ApiError(Exception):
    """A request the server answers with an error: status, message, and OpenAI's type for it
    (extra: more fields of the error object, as llama-server's n_prompt_tokens and n_ctx)."""

    def __init__(self, status: int, message: str, error_type: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = error_type or ERROR_TYPES.get(status, "invalid_request_error")
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.status, **self.extra}}


def bad(message: str, **extra) -> ApiError:
    return ApiError(400, message, **extra)


async def read_json(request) -> dict:
    """The body as a JSON object (400 for anything else)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    return data


_KINDS = {"integer": int, "number": (int, float), "boolean": bool, "string": str, "object": dict, "array": list}


def check_type(name: str, value, kind: str):
    """value, when it is of the JSON kind (a boolean is not a number); else a 400 naming the field."""
    if isinstance(value, _KINDS[kind]) and (kind == "boolean" or not isinstance(value, bool)):
        return value
    raise bad(f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {shown(value)}")


def shown(value) -> str:
    """A value as a message quotes it: its JSON, cut at 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """A JSON object's fields: a field it does not know is a 400, and so is one of the wrong type;
    a missing or null one is its default. `where` names the object in messages."""

    def __init__(self, data, known, where: str = ""):
        self.where = where
        check_type(where.rstrip(".") or "the request body", data, "object")
        unknown = [name for name in data if name not in known]
        if unknown:
            raise bad(f"unknown field {where}{unknown[0]}")
        self.data = data

    def get(self, name: str, kind: str, default=None):
        value = self.data.get(name)
        return default if value is None else check_type(self.where + name, value, kind)

    def require(self, name: str, kind: str):
        if self.data.get(name) is None:
            raise bad(f"{self.where}{name} is required")
        return self.get(name, kind)

    def strings(self, name: str) -> tuple[str, ...]:
        """A string or an array of strings (as `stop`)."""
        value = self.data.get(name)
        values = ([] if value is None else [value] if isinstance(value, str)
                  else check_type(f"{self.where}{name}", value, "array"))
        for v in values:
            check_type(f"{self.where}{name}", v, "string")
            if not v:
                raise bad(f"{self.where}{name}: an empty string would stop before the first token")
        return tuple(values)

    def count(self, name: str, low: int = 0, high: int | None = None, default=None):
        """An integer from low to high."""
        value = self.get(name, "integer", default)
        if value is not None and (value < low or (high is not None and value > high)):
            raise bad(f"{self.where}{name} must be from {low} to {high}, not {value}" if high is not None
                      else f"{self.where}{name} must be at least {low}, not {value}")
        return value


# SamplingOptions' fields, as requests may set them (OpenAI's names, llama-server's and Ollama's)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "repeat_last_n")


def sampling(defaults: SamplingOptions, fields: Fields) -> SamplingOptions:
    """The server's sampling options with what the request sets (SamplingOptions checks them)."""
    given = {name: fields.data[name] for name in SAMPLING_FIELDS if fields.data.get(name) is not None}
    try:
        return dataclasses.replace(defaults, **given)
    except OptionError as e:
        raise bad(f"{fields.where}{e.option} {e.problem}") from None


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(value, known) -> list[dict]:
    """A conversation as the chat template takes it: each message's role, its text, and a reply's
    reasoning (OpenAI's reasoning_content, Ollama's thinking); `known`: the fields a message may have."""
    check_type("messages", value, "array")
    messages = []
    for i, m in enumerate(value):
        f = Fields(m, known, f"messages[{i}].")
        role = f.require("role", "string")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}")
        if f.get("images", "array"):
            raise bad(f"messages[{i}]: images are not supported yet")
        message = {"role": "system" if role == "developer" else role,
                   "content": _text(f.data.get("content"), f"messages[{i}].content")}
        reasoning = f.get("reasoning_content", "string") or f.get("thinking", "string")
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = f.get("tool_calls", "array")
        if calls:
            message["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        for key, name in (("tool_call_id", "tool_call_id"), ("name", "name"), ("tool_name", "name")):
            if (value := f.get(key, "string")) is not None:  # (Ollama's tool_name: OpenAI's name)
                message[name] = value
        messages.append(message)
    return messages


def _tool_call(value, where: str) -> dict:
    """An assistant's tool call as templates read it: its arguments as an object (OpenAI sends
    them as JSON text, Ollama as an object)."""
    f = Fields(check_type(where, value, "object"), ("id", "type", "function", "index"), f"{where}.")
    fn = Fields(f.require("function", "object"), ("name", "arguments", "index"), f"{where}.function.")
    name, arguments = fn.require("name", "string"), fn.data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except (json.JSONDecodeError, RecursionError):
            raise bad(f"{where}.function.arguments is not JSON: {shown(arguments)}") from None
    if not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments must be a JSON object, not {shown(arguments)}")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"id": f.get("id", "string"), **call} if f.data.get("id") is not None else call


def _text(content, name: str) -> str:
    """A message's content: a string, or OpenAI's array of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(check_type(name, content, "array")):
        kind = check_type(f"{name}[{j}]", part, "object").get("type")
        if kind != "text":
            raise bad(f"{name}[{j}] is {kind!r} content: only text is supported")
        parts.append(Fields(part, ("type", "text"), f"{name}[{j}].").require("text", "string"))
    return "".join(parts)
