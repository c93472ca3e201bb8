"""Tool calls in `ggrun serve` (runner/serve/tools.py, text/tool_calls.py) through the `openai`
and `ollama` clients against real servers: for each family's format, a tiny random model that
carries the family's real template (llama.cpp b11434's models/templates, Phi-4-mini's from
tests/data) and its control tokens, where tool_choice "required" returns parsed calls whose
arguments validate against the tool's schema, streamed deltas reassemble into the same calls, and
the tools, a call and its result render (llama-server's /apply-template); on SmolLM2 (a template with no tool format: Hermes, its tools
described in a system message), auto, none, a named tool, parallel_tool_calls, Ollama's tools and
the 400s of malformed tools."""
from __future__ import annotations

import json

import httpx
import pytest

from .template_models import write_template_model
from .test_serve import _error, start  # noqa: F401 (a fixture)
from .test_serve_grammar import server  # noqa: F401 (a fixture: SmolLM2 served, 4 slots)
from .test_tool_calls import ADD, FAMILIES, WEATHER, template_text

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "The sum of two numbers",
                                           "parameters": ADD}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SERVED = ("qwen2.5", "qwen3.5", "llama3.2", "mistral-nemo", "mistral-small-3.2", "gpt-oss", "granite3.3", "glm4.6",
          "gemma4", "phi-4-mini", "seed-oss", "functionary-v3.1", "functionary-v3.2", "firefunction-v2", "lfm2",
          "nemotron-nano-v2", "deepseek-r1-distill-qwen", "apriel-1.6",
          "smollm3")  # (a family for each format, and one with no tool format)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def valid(calls) -> bool:
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return bool(calls)


def streamed_calls(client, model, **kwargs) -> tuple[list[tuple[str, dict]], str, str]:
    """The calls reassembled from a streamed reply's deltas, its content and its finish reason."""
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], content, finish


@pytest.mark.parametrize("family", SERVED)
def test_each_familys_calls(family, llama_cpp_source, tmp_path, start):  # noqa: F811
    path = write_template_model(tmp_path / f"{family}.gguf", template_text(llama_cpp_source, family),
                                FAMILIES[family][2])
    served = start(path, "-c", 8192)  # (a byte-token vocabulary: long prompts)
    served.wait_ready()
    client = served.openai()
    # (one call: a random model would go on calling to max_tokens)
    ask = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
           "max_tokens": 2000}
    if family == "gpt-oss":  # (at temperature 0 a random model reasons forever in the analysis channel)
        ask.update(temperature=1, seed=7)
    reply = client.chat.completions.create(model=path.name, **ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and valid(calls_of(choice.message)), choice
    assert streamed_calls(client, path.name, **ask)[0] == calls_of(choice.message)
    call = choice.message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "RESULT-4242"}]
    prompt = httpx.post(served.url + "/apply-template", json={"messages": history, "tools": TOOLS}).json()["prompt"]
    before, after = prompt.split(ASK[0]["content"], 1)
    assert "get_weather" in before and "RESULT-4242" in after and call.function.name in after  # (tools, call, result)
    reply = client.chat.completions.create(model=path.name, messages=history, tools=TOOLS, max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert served.stop() == 130 and "Traceback" not in served.log() and " 500 " not in served.log()


def test_tool_choice_on_smollm2(server, smollm_path):  # noqa: F811
    client, model = server.openai(), smollm_path.name

    def ask(**kwargs):
        return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=120,
                                              **{"temperature": 0, **kwargs}).choices[0]
    for seed in (1, 2, 3):  # (sampled at temperature 1, every call valid)
        choice = ask(tool_choice="required", temperature=1, seed=seed, parallel_tool_calls=False)
        assert choice.finish_reason == "tool_calls" and valid(calls_of(choice.message))
    named = ask(tool_choice={"type": "function", "function": {"name": "add"}})
    assert {name for name, _ in calls_of(named.message)} == {"add"} and valid(calls_of(named.message))
    one = ask(tool_choice="required", parallel_tool_calls=False)
    assert len(one.message.tool_calls) == 1
    for choice in (ask(), ask(tool_choice="none")):  # (SmolLM2 answers in text: no call)
        assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"
    calls, content, finish = streamed_calls(client, model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=120)
    assert finish == "tool_calls" and valid(calls) and content == ""


def test_ollama_tools(server, smollm_path):  # noqa: F811
    """Ollama's tools and a tool result in its history (tool_name); its reply as text where the model
    calls none."""
    client = ollama.Client(host=server.url)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"}]
    reply = client.chat(model=smollm_path.name, messages=history, tools=TOOLS, options={"temperature": 0,
                                                                                         "num_predict": 12})
    assert reply.message.content and not reply.message.tool_calls
    shown = client.show(smollm_path.name)
    assert "tools" in shown.capabilities


def test_malformed_tools_are_400s(server, smollm_path):  # noqa: F811
    url = server.url + "/v1/chat/completions"

    def post(**body):
        return httpx.post(url, json={"model": smollm_path.name, "messages": ASK, "max_tokens": 4, **body})
    fn = TOOLS[0]["function"]
    cases = [({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
             ({"tools": [{"type": "function", "function": {**fn, "name": "get weather"}}]}, "letters, digits"),
             ({"tools": [TOOLS[0], TOOLS[0]]}, "twice"),
             ({"tools": [{"type": "function", "function": {**fn, "parameters": {"type": "strin"}}}]}, "parameters"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
             ({"tool_choice": "required"}, "no tools"),
             ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot both"),
             ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
                 {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
              "not JSON")]
    for body, words in cases:
        _error(post(**body), 400, words)
