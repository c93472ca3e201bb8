"""Structured output in `ggrun serve` (runner/serve/structured.py, the batcher's matchers): OpenAI's
response_format through the `openai` client, Ollama's format through the `ollama` client,
llama-server's grammar and json_schema fields through httpx, on a real server over SmolLM2.
Every reply validates with the jsonschema package (sampled at temperature 1 under several seeds);
requests with different schemas batch together, each reply its own, and at temperature 0 the same
text as alone; invalid and unenforceable schemas are 400s that name the problem."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from .test_serve import N_CTX, Server, _error

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

SYSTEM = "You are a helpful assistant. You reply with JSON only."
SEEDS = (1, 2, 3)
MAX_TOKENS = 128  # (every schema bounds its strings, numbers and arrays: replies end well before)

_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    ("a colour", {**_OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a person", {**_OBJ, "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a few scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                      "minItems": 1, "maxItems": 3}),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
]


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-grammar"), smollm_path, "-c", N_CTX, "-np", 4)
    s.wait_ready()
    yield s
    assert s.stop() == 130 and "Traceback" not in s.log() and " 500 " not in s.log()


@pytest.fixture(scope="module")
def name(server):
    return server.openai().models.list().data[0].id


def ask(what: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Give me {what}."}]


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def constrained(server, name, what, schema, **kwargs):
    return server.openai().chat.completions.create(model=name, messages=ask(what), response_format=schema_format(schema),
                                                    **{"max_tokens": MAX_TOKENS, **kwargs})


@pytest.mark.parametrize("what, schema", SCHEMAS, ids=[w for w, _ in SCHEMAS])
def test_response_format_json_schema_holds_when_sampling(server, name, what, schema):
    for seed in SEEDS:
        reply = constrained(server, name, what, schema, temperature=1, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_and_streamed_deltas(server, name):
    """json_object: any JSON object; streamed deltas reassemble into the whole reply's JSON."""
    client = server.openai()
    person = SCHEMAS[1][1]
    for seed in SEEDS[:2]:
        reply = client.chat.completions.create(model=name, messages=ask("a JSON object with a name and an age"),
                                               response_format={"type": "json_object"}, temperature=1, seed=seed,
                                               max_tokens=MAX_TOKENS)
        if reply.choices[0].finish_reason == "stop":  # (any object's strings are unbounded: length may cut one)
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
        else:
            assert reply.choices[0].finish_reason == "length"
    whole = constrained(server, name, "a person", person, temperature=0)
    chunks = list(server.openai().chat.completions.create(model=name, messages=ask("a person"), temperature=0,
                                                          response_format=schema_format(person),
                                                          max_tokens=MAX_TOKENS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), person)


def test_max_tokens_inside_the_structure_says_length(server, name):
    reply = constrained(server, name, "a person", SCHEMAS[1][1], temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_bad_schemas_are_400s_naming_the_problem(server, name):
    for schema, words in (({"type": "hiccup"}, ("invalid JSON schema", "hiccup")),
                          ({"type": "array", "uniqueItems": True}, ("cannot be enforced", "uniqueItems")),
                          ({"type": "object", "minProperties": 3}, ("cannot be enforced", "minProperties"))):
        with pytest.raises(openai.BadRequestError) as e:
            constrained(server, name, "anything", schema)
        assert e.value.status_code == 400 and all(w in e.value.message for w in words), e.value.message
    url = server.url + "/v1/chat/completions"
    hello = [{"role": "user", "content": "Hello"}]

    def post(body):
        return httpx.post(url, json={"messages": hello, "max_tokens": 4, **body})
    _error(post({"response_format": {"type": "sound"}}), 400, "response_format.type", "sound")
    _error(post({"response_format": {}}), 400, "response_format.type is required")
    _error(post({"response_format": {"type": "json_schema", "json_schema": {"schema": 123}}}), 400,
           "response_format.json_schema.schema must be a JSON schema")
    _error(post({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}), 400,
           "strict")
    _error(post({"grammar": "root ::= this is (not valid GBNF"}), 400, "invalid grammar")
    _error(post({"grammar": 'root ::= "a"', "json_schema": {"type": "integer"}}), 400, "grammar and json_schema")
    _error(post({"json_schema": {"type": "integer"}, "response_format": {"type": "json_object"}}), 400,
           "json_schema and response_format")
    completions = server.url + "/v1/completions"
    _error(httpx.post(completions, json={"prompt": "x", "json_schema": "nope"}), 400, "json_schema must be")
    _error(httpx.post(completions, json={"prompt": "x", "response_format": {"type": "json_object"}}), 400,
           "unknown field response_format")


def test_ollama_format(server, name):
    client = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    r = client.chat(model=name, messages=ask("a JSON object with a name and an age"), format="json", options=options)
    assert r.done_reason in ("stop", "length")
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    what, schema = SCHEMAS[1]
    for seed in SEEDS[:2]:
        sampled = {"temperature": 1, "seed": seed, "num_predict": MAX_TOKENS}
        r = client.chat(model=name, messages=ask(what), format=schema, options=sampled)
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), schema)
        g = client.generate(model=name, prompt=f"Give me {what}.", system=SYSTEM, format=schema, options=sampled)
        assert g.done_reason == "stop"
        jsonschema.validate(json.loads(g.response), schema)
    streamed = "".join(p.message.content for p in client.chat(model=name, messages=ask(what), format=schema,
                                                              options=options, stream=True))
    assert streamed == client.chat(model=name, messages=ask(what), format=schema, options=options).message.content
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=ask(what), format={"type": "hiccup"})
    assert e.value.status_code == 400 and "hiccup" in e.value.error


def test_llama_server_grammar_and_json_schema_fields(server, name):
    """llama-server's `grammar` (GBNF) and `json_schema`, on /v1/completions and /completions, on its
    own /completion, and on chat (where the openai client sends them as extra_body)."""
    for path in ("/v1/completions", "/completions"):
        for seed in SEEDS:
            r = httpx.post(server.url + path, json={"prompt": "Is water wet? Answer:", "max_tokens": 8, "seed": seed,
                                                    "temperature": 1, "grammar": 'root ::= " " ("yes" | "no") "!"'},
                           timeout=120).json()
            assert r["choices"][0]["text"] in (" yes!", " no!") and r["choices"][0]["finish_reason"] == "stop"
    five = httpx.post(server.url + "/v1/completions", json={"prompt": "Say a", "max_tokens": 8, "temperature": 1,
                                                            "grammar": 'root ::= "a"{5,5}'}, timeout=120).json()
    assert five["choices"][0]["text"] == "aaaaa"
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "A number:", "max_tokens": 8, "temperature": 1,
                                                         "seed": 1, "json_schema": number}, timeout=120).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), number)
    # llama-server's own /completion: n_predict, its reply's content and stop_type, streamed alike
    body = {"prompt": "A number:", "n_predict": 8, "temperature": 0, "json_schema": number}
    r = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    jsonschema.validate(json.loads(r["content"]), number)
    assert r["stop"] and r["stop_type"] == "eos" and r["tokens_predicted"] <= 8 and r["timings"]["predicted_n"]
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == r["content"] and events[-1]["stop"]
    r = httpx.post(server.url + "/completion", json={"prompt": "Is water wet? Answer:", "n_predict": 8,
                                                     "grammar": 'root ::= " " ("yes" | "no") "!"'}, timeout=120)
    assert r.json()["content"] in (" yes!", " no!")
    _error(httpx.post(server.url + "/completion", json={"prompt": "x", "grammar": "root ::= nope"}), 400, "grammar")
    client = server.openai()
    reply = client.chat.completions.create(model=name, messages=ask("a number"), max_tokens=8, temperature=1,
                                           extra_body={"json_schema": number})
    jsonschema.validate(json.loads(reply.choices[0].message.content), number)
    reply = client.chat.completions.create(model=name, messages=ask("an answer"), max_tokens=8, temperature=1,
                                           extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert reply.choices[0].message.content in ("yes.", "no.")


def at_once(server, name, **kwargs) -> list[str]:
    """SCHEMAS' requests sent together, one thread each; their replies' text."""
    texts: list[str] = [""] * len(SCHEMAS)
    barrier = threading.Barrier(len(SCHEMAS))

    def one(i: int) -> None:
        what, schema = SCHEMAS[i]
        barrier.wait()
        texts[i] = constrained(server, name, what, schema, **kwargs).choices[0].message.content
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(SCHEMAS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return texts


def test_concurrent_requests_with_different_schemas(server, name):
    """Four requests with four schemas at once (batched, -np 4): each reply follows its own schema,
    and at temperature 0 says what it says alone."""
    alone = [constrained(server, name, what, schema, temperature=0).choices[0].message.content
             for what, schema in SCHEMAS]
    assert at_once(server, name, temperature=0) == alone
    for texts in (alone, at_once(server, name, temperature=1, seed=7)):
        for text, (_, schema) in zip(texts, SCHEMAS):
            jsonschema.validate(json.loads(text), schema)
