"""Constrained decoding (runner/engine/constraint.py): JSON schemas and llama.cpp's GBNF grammars
enforced on SmolLM2 and Gemma 3 while sampling at temperature 1 (every output validated by the
jsonschema package, or parsed by a parser of its grammar's language), greedy decoding, forced
tokens, where a generation stops and why, speculative decoding under a grammar, schemas and
grammars refused with the problem named, and the command line's flags."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from runner.engine.constraint import Grammar, GrammarError, Matcher, guidance_tokenizer
from runner.engine.sampler import Sampler, SamplingOptions
from runner.text.reasoning import ReplyDecoder, SplitReply

from .test_chat import harmony_model  # noqa: F401 (a fixture)

jsonschema = pytest.importorskip("jsonschema")
regex = pytest.importorskip("regex")

SYSTEM = "You are a helpful assistant. You reply with JSON only."
SEEDS = (1, 2, 3)
MAX_TOKENS = 160  # (every schema below bounds its strings, arrays and objects: outputs end well before)

_S = {"type": "string", "maxLength": 16}  # a bounded string
_OBJ = {"type": "object", "additionalProperties": False}

# (what the prompt asks for, the schema)
SCHEMAS = [
    ("a colour", {**_OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("an answer: yes, no or maybe", {"enum": ["yes", "no", "maybe"]}),
    ("whether the sky is blue", {"type": "boolean"}),
    ("a number from 1 to 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    # (a number's fraction is unbounded: at temperature 1 SmolLM2 once wrote 150 digits of one)
    ("a probability", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.25}),
    ("a person with an address", {**_OBJ, "properties": {
        "name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {**_OBJ, "properties": {"street": {"type": "string", "maxLength": 24}, "city": _S,
                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]}},
        "required": ["name", "age", "address"]}),
    ("a few scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                      "minItems": 2, "maxItems": 4}),
    ("some fruits", {"type": "array", "items": {"enum": ["apple", "pear", "plum", "fig"]}, "minItems": 1,
                     "maxItems": 3}),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
    ("a digit or a short word", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "maxLength": 5}]}),
    ("a shape", {"oneOf": [
        {**_OBJ, "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                        "maximum": 50}},
         "required": ["kind", "radius"]},
        {**_OBJ, "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                      "maximum": 50}},
         "required": ["kind", "side"]}]}),
    ("a line segment", {"$defs": {"point": {**_OBJ, "properties": {"x": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9},
                                                                   "y": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9}},
                                            "required": ["x", "y"]}},
                        **_OBJ, "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                        "required": ["start", "end"]}),
    ("a film", {**_OBJ, "properties": {"title": {"type": "string", "maxLength": 30},
                                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                       "rating": {"type": "integer", "minimum": 0, "maximum": 10}},
                "required": ["title"]}),
    ("a versioned name", {**_OBJ, "properties": {"version": {"const": 2}, "name": _S},
                          "required": ["version", "name"]}),
    ("true, false or null", {"type": ["boolean", "null"]}),
    ("a short word", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("a multiple of five", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("a shopping list", {"type": "array", "items": {**_OBJ, "properties": {
        "name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "qty"]}, "minItems": 1, "maxItems": 3}),
    ("a name and an age", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                                            {"type": "integer", "minimum": 0, "maximum": 120}],
                           "items": False, "minItems": 2}),
    ("a map of names to digits", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}, "maxProperties": 3}),
    ("two facts", {**_OBJ, "properties": {"a": True, "b": True},
                   "allOf": [{"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a"]},
                             {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}),
    ("an event with a date", {**_OBJ, "properties": {"event": {"type": "string", "maxLength": 20},
                                                     "date": {"type": "string", "format": "date"}},
                              "required": ["event", "date"]}),
    ("a tree of two levels", {"$defs": {"leaf": {**_OBJ, "properties": {"value": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
                                                 "required": ["value"]}},
                              **_OBJ, "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9},
                                                     "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"},
                                                                  "maxItems": 2}},
                              "required": ["value", "children"]}),
    ("one of 1, two, null or true", {"enum": [1, "two", None, True]}),
    ("a small grid of digits", {"type": "array", "items": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}, "minItems": 1, "maxItems": 3}),
    ("an identifier", {"type": "string", "format": "uuid"}),
    ("an account's state", {**_OBJ, "properties": {"active": {"type": "boolean"}, "note": {"type": "null"}},
                            "required": ["active", "note"]}),
    ("some x_ settings", {"type": "object", "patternProperties": {"^x_[a-z]{1,5}$": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9}},
                          "additionalProperties": False, "maxProperties": 2}),
    ("some flags, at least one", {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1,
                                  "maxProperties": 2}),
    ("a temperature below freezing", {"type": "integer", "minimum": -50, "maximum": -10}),
    ("a colour code", {**_OBJ, "properties": {"code": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                       "required": ["code"]}),
    ("a contact, by phone or by email", {"anyOf": [
        {**_OBJ, "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}, "required": ["phone"]},
        {**_OBJ, "properties": {"user": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                "domain": {"enum": ["example.com", "example.org"]}},
         "required": ["user", "domain"]}]}),
    ("a percentage", {**_OBJ, "properties": {"percent": {"type": "integer", "minimum": 0, "exclusiveMaximum": 100}},
                      "required": ["percent"]}),
]
# a few of them on Gemma 3 too (its 262k-token vocabulary: other tokens, other masks)
GEMMA_SCHEMAS = [SCHEMAS[i] for i in (0, 5, 8, 11, 17, 21)]


def complete(lm, prompt: str, grammar: Grammar | None, seed: int | None = None, temperature: float = 1.0,
             max_tokens: int = MAX_TOKENS, system: str | None = SYSTEM, stop_ids=None, drafter=None):
    """The text of a completion of prompt (through the chat template when system is given), and its stats."""
    from runner.engine.session import Session
    session = Session(lm, lm.model.new_cache(1024), drafter, draft_max=6)
    ids = session.prompt_ids(prompt, system)
    sampler = Sampler(SamplingOptions(temperature=temperature, seed=seed))
    text = "".join(session.complete(ids, sampler, max_tokens, stop_ids=stop_ids, grammar=grammar))
    return text, session.stats


def check_json(text: str, schema) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from runner.engine.load import LoadOptions, load_model
    return load_model(gemma_path, LoadOptions(kv_type="f32"))


# -- JSON schemas on the real models ------------------------------------------------------------

def test_there_are_at_least_thirty_schemas():
    assert len(SCHEMAS) >= 30
    for _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("what, schema", SCHEMAS, ids=[what for what, _ in SCHEMAS])
def test_sampled_json_follows_its_schema_on_smollm(smollm, what, schema):
    grammar = Grammar.json_schema(schema)
    for seed in SEEDS:
        text, stats = complete(smollm, f"Give me {what}.", grammar, seed)
        assert stats.stop_reason == "eos", (seed, text)
        check_json(text, schema)


@pytest.mark.parametrize("what, schema", GEMMA_SCHEMAS, ids=[what for what, _ in GEMMA_SCHEMAS])
def test_sampled_json_follows_its_schema_on_gemma(gemma, what, schema):
    grammar = Grammar.json_schema(schema)
    for seed in SEEDS[:2]:
        text, stats = complete(gemma, f"Give me {what}.", grammar, seed)
        assert stats.stop_reason == "eos", (seed, text)
        check_json(text, schema)


# -- llama.cpp's GBNF grammars -------------------------------------------------------------------

_EN = r"""[a-zA-Z0-9!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
_JP = r"[ぁ-ゟァ-ヿ、-〾一-鿿]"
_MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
# Each grammar's language as a regular expression of the `regex` module (its recursion for
# arithmetic's parentheses), written from the grammar; json.loads for JSON. Partial matches check
# an output that max_tokens cut: a prefix of the language.
LANGUAGES = {
    "arithmetic.gbnf": (r"(?(DEFINE)(?P<ws>[ \t\n]*)(?P<term>[a-z][a-z0-9_]*(?&ws)|[0-9]+(?&ws)|\((?&ws)(?&expr)\)(?&ws))"
                        r"(?P<expr>(?&term)(?:[-+*/](?&term))*))(?:(?&expr)=(?&ws)(?&term)\n)+"),
    "chess.gbnf": rf"1\. {_MOVE} {_MOVE}\n(?:[1-9][0-9]?\. {_MOVE} {_MOVE}\n)+",
    "english.gbnf": rf"{_EN}+(?:[ \t\n]{_EN}+)*",
    "japanese.gbnf": rf"{_JP}+(?:[ \t\n]{_JP}+)*",
    "list.gbnf": r"(?:- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+",
}
PROMPTS = {
    "arithmetic.gbnf": "Write two equations, such as x = 3 + 4.",
    "c.gbnf": "Write a short C function that adds two numbers.",
    "chess.gbnf": "Write the first moves of a chess game in algebraic notation.",
    "english.gbnf": "Say hello in one short sentence.",
    "japanese.gbnf": "Say hello in Japanese.",
    "json.gbnf": "Describe a cat as a JSON object.",
    "json_arr.gbnf": "List three colours as a JSON array.",
    "list.gbnf": "List three fruits.",
}


def llama_cpp_grammars(source):
    return sorted((source / "grammars").glob("*.gbnf"))


def test_every_llama_cpp_grammar_is_covered(llama_cpp_source):
    assert {path.name for path in llama_cpp_grammars(llama_cpp_source)} == set(PROMPTS)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_llama_cpp_grammars_hold_on_smollm(smollm, llama_cpp_source, name):
    """Each output (greedy, and two seeds at temperature 1) in its grammar's language: parsed by
    json.loads (json, json_arr) or the language's regular expression where it ended, a prefix of
    the language where max_tokens cut it. Every output's text also re-parses, byte by byte, through a
    fresh llguidance matcher (complete where it ended); c.gbnf has no other parser here."""
    import llguidance
    grammar = Grammar.gbnf((llama_cpp_source / "grammars" / name).read_text())
    bytewise = llguidance.LLTokenizer("byte")  # (one token per byte: the text, whatever its tokens were)
    for seed, temperature in ((None, 0.0), (1, 1.0), (2, 1.0)):
        text, stats = complete(smollm, PROMPTS[name], grammar, seed, temperature, max_tokens=96,
                               system="You are a helpful assistant.")
        assert stats.stop_reason in ("eos", "length"), stats.stop_reason
        ended = stats.stop_reason == "eos"
        if name in ("json.gbnf", "json_arr.gbnf") and ended:
            value = json.loads(text)
            assert isinstance(value, dict if name == "json.gbnf" else list)
        if name in LANGUAGES:  # (a cut may end inside a character: its bytes so far print as U+FFFD)
            match = regex.fullmatch(LANGUAGES[name], text if ended else text.rstrip("\ufffd"), partial=not ended)
            assert match is not None, (temperature, text)
        reparsed = llguidance.LLMatcher(bytewise, grammar.compiled, log_level=0)
        data = b"".join(smollm.tokenizer.token_bytes(t) for t in stats.tokens)
        assert reparsed.consume_tokens(list(data)), (text, reparsed.get_error())
        assert reparsed.is_accepting() or not ended, text


# -- greedy decoding, forced tokens, stops -------------------------------------------------------

def test_greedy_output_follows_the_grammar_and_repeats(smollm):
    schema = SCHEMAS[5][1]
    grammar = Grammar.json_schema(schema)
    first, stats = complete(smollm, "Give me a person with an address.", grammar, temperature=0)
    second, _ = complete(smollm, "Give me a person with an address.", grammar, temperature=0)
    assert stats.stop_reason == "eos" and first == second
    check_json(first, schema)


def test_greedy_picks_the_best_allowed_token(smollm):
    """Greedy under a grammar is the argmax of the model's logits over the allowed tokens."""
    from runner.engine.generate import generate
    grammar = Grammar.gbnf('root ::= "The capital of France is " ("Paris" | "Rome" | "Berlin") "."')
    ids = smollm.tokenizer.encode("Q: What is the capital of France?\nA:")
    matcher = Matcher(grammar, smollm.tokenizer, smollm.params.vocab_size)
    tokens = list(generate(smollm.model, smollm.model.new_cache(256), ids, Sampler(SamplingOptions(temperature=0)),
                           32, smollm.tokenizer.vocab.end_of_generation, matcher=matcher))
    assert smollm.tokenizer.decode(tokens) == "The capital of France is Paris."
    replay, cache = Matcher(grammar, smollm.tokenizer, smollm.params.vocab_size), smollm.model.new_cache(256)
    logits = smollm.model.forward(ids, cache)
    for token in tokens:
        allowed = replay.allowed()
        assert token == int(np.argmax(np.where(allowed, logits, -np.inf)))
        replay.accept(token)
        logits = smollm.model.forward([token], cache)


def test_a_forced_token_is_taken_without_sampling(smollm):
    tok = smollm.tokenizer
    matcher = Matcher(Grammar.gbnf('root ::= "hello world"'), tok, smollm.params.vocab_size)
    forced = matcher.forced()
    assert forced is not None and tok.decode([forced]) == "hello"
    allowed = matcher.allowed()
    logits = np.zeros(smollm.params.vocab_size, dtype=np.float32)
    logits[forced] = -100.0  # (the model's least likely token: still the one taken)
    sampler = Sampler(SamplingOptions(temperature=1.0, seed=0))
    state = sampler.rng.bit_generator.state
    choice = sampler.choose(logits, [], allowed)
    assert choice.token == forced and list(choice.ids) == [forced]
    assert sampler.rng.bit_generator.state == state  # (no draw)
    text, stats = complete(smollm, "Say something.", Grammar.gbnf('root ::= "hello world"'), seed=3)
    assert text == "hello world" and stats.stop_reason == "eos"


def test_masked_sampling_draws_only_allowed_tokens():
    """Without a model: the filters (top-k, top-p, min-p) work over the allowed tokens only, so a
    mask of low-logit tokens still yields one of them."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    allowed = np.zeros(1000, dtype=bool)
    allowed[np.argsort(logits)[:5]] = True  # the five least likely
    for options in (SamplingOptions(temperature=1.0, seed=1), SamplingOptions(temperature=0),
                    SamplingOptions(temperature=1.0, top_k=2, top_p=0.5, min_p=0.5, seed=2, repeat_penalty=1.3)):
        sampler = Sampler(options)
        for _ in range(50):
            choice = sampler.choose(logits, [1, 2, 3], allowed)
            assert allowed[choice.token] and allowed[choice.ids].all()
            assert np.isfinite(choice.logprobs).all()


def test_max_tokens_inside_the_structure_says_length(smollm):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 20}
    text, stats = complete(smollm, "Give me many numbers.", Grammar.json_schema(schema), seed=1, max_tokens=8)
    assert stats.stop_reason == "length" and stats.generated_tokens == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_a_grammar_complete_at_max_tokens_says_eos(smollm):
    text, stats = complete(smollm, "Yes or no?", Grammar.gbnf('root ::= "yes"'), seed=1, max_tokens=1)
    assert text == "yes" and stats.stop_reason == "eos"


def test_ignore_eos_goes_on_while_the_grammar_can(smollm):
    """Without stop ids (--ignore-eos) the end-of-generation tokens are masked while the grammar
    goes on: max_tokens ends it; where the grammar is complete it ends all the same."""
    grammar = Grammar.gbnf('root ::= ("a" | "b")+')
    text, stats = complete(smollm, "Letters:", grammar, seed=1, max_tokens=12, stop_ids=())
    assert stats.stop_reason == "length" and regex.fullmatch("[ab]+", text) and stats.generated_tokens == 12
    text, stats = complete(smollm, "Yes or no?", Grammar.gbnf('root ::= "yes" | "no"'), seed=1, stop_ids=())
    assert text in ("yes", "no") and stats.stop_reason == "eos"


def test_control_tokens_are_marked_and_the_tokenizer_is_built_once(smollm):
    tok = smollm.tokenizer
    built = guidance_tokenizer(tok)
    assert guidance_tokenizer(tok) is built
    im_end = tok.token_to_id["<|im_end|>"]
    assert built.is_special_token(im_end) and not built.is_special_token(tok.token_to_id["Hello"])
    ids = tok.encode("Hello, world! 123", add_special=False)
    assert built.decode_bytes(ids) == b"Hello, world! 123"
    assert set(built.eos_tokens) == set(tok.vocab.end_of_generation)


# -- speculative decoding under a grammar ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_speculation_under_a_grammar_is_plain_decoding_at_temperature_0(smollm, kind):
    """The same text as without speculation at --temp 0: drafts (the target drafting for itself,
    unconstrained, or a lookup in the prompt) are cut where the grammar rejects them."""
    from runner.engine.speculative import DraftModel, PromptLookup
    schema = SCHEMAS[17][1]
    grammar = Grammar.json_schema(schema)
    prompt = 'Give me a shopping list. For example [{"name": "milk", "qty": 2}, {"name": "eggs", "qty": 6}].'
    plain, plain_stats = complete(smollm, prompt, grammar, temperature=0)
    drafter = DraftModel(smollm, 1024, ring=False, p_min=0.0) if kind == "draft" else PromptLookup(2)
    spec, spec_stats = complete(smollm, prompt, grammar, temperature=0, drafter=drafter)
    assert spec == plain and spec_stats.tokens == plain_stats.tokens and spec_stats.stop_reason == "eos"
    check_json(spec, schema)


def test_speculation_under_a_grammar_samples_valid_output(smollm):
    from runner.engine.speculative import DraftModel
    for what, schema in (SCHEMAS[5], SCHEMAS[11]):
        drafter = DraftModel(smollm, 1024, ring=False, p_min=0.0)
        for seed in (1, 2):
            text, stats = complete(smollm, f"Give me {what}.", Grammar.json_schema(schema), seed, drafter=drafter)
            assert stats.stop_reason == "eos", text
            check_json(text, schema)


# -- refused schemas and grammars ------------------------------------------------------------------

REFUSED_SCHEMAS = [
    ({"type": "object", "not": {"required": ["a"]}}, "cannot be enforced", '"not"'),
    ({"type": "array", "uniqueItems": True}, "cannot be enforced", "uniqueItems"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "cannot be enforced", '"if"'),
    ({"type": "array", "contains": {"type": "integer"}}, "cannot be enforced", "contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "cannot be enforced", "dependentRequired"),
    ({"type": "object", "unevaluatedProperties": False}, "cannot be enforced", "unevaluatedProperties"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "cannot be enforced", "oneOf"),
    ({"type": "string", "format": "credit-card"}, "cannot be enforced", "credit-card"),
    ({"type": "string", "pattern": "(?=a)b"}, "cannot be enforced", "look-around"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "cannot be enforced",
     "minProperties 2"),
    ({"type": "object", "x-guidance": {"lenient": True}, "not": {}}, "cannot be enforced", '"not"'),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "invalid JSON schema", "minimum (5) is greater than maximum (1)"),
    ({"type": "strng"}, "invalid JSON schema", "strng"),
    ({"$ref": "#/$defs/missing"}, "invalid JSON schema", "/$defs/missing"),
    ({"type": "string", "pattern": "(a"}, "invalid JSON schema", "unclosed group"),
    ('{"type": "object",', "not JSON", "line 1"),
    ("[1, 2]", "a JSON schema is an object", "list"),
]


@pytest.mark.parametrize("schema, kind, problem", REFUSED_SCHEMAS, ids=[p for _, _, p in REFUSED_SCHEMAS])
def test_unenforceable_or_invalid_schemas_are_refused_naming_the_problem(schema, kind, problem):
    with pytest.raises(GrammarError) as e:
        Grammar.json_schema(schema)
    assert kind in str(e.value) and problem in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, problem", [("root ::= foo", "Rule 'foo' not found"), ('x ::= "a"', "root"),
                                           ('root ::= "a', "end of input"), ("root ::= [a-", "end of input")])
def test_invalid_grammars_are_refused_naming_the_problem(text, problem):
    with pytest.raises(GrammarError) as e:
        Grammar.gbnf(text)
    assert str(e.value).startswith("invalid grammar: ") and problem in str(e.value)


def test_a_schema_nested_past_pythons_recursion_is_refused():
    """A hostile schema's depth is an error, not a RecursionError: as text (the command line), and
    as parsed JSON as deep as a request body can be (serve)."""
    with pytest.raises(GrammarError, match="nested too deeply"):
        Grammar.json_schema('{"a":' * 5000 + "1" + "}" * 5000)
    deep = {"type": "integer"}
    for _ in range(900):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        Grammar.json_schema(deep)


def test_a_warning_from_llguidance_is_a_refusal(monkeypatch):
    """Whatever llguidance's validation warns of (it would not enforce it) refuses the grammar."""
    import llguidance
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings",
                        staticmethod(lambda grammar, tokenizer=None: (False, ["keyword x ignored"])))
    with pytest.raises(GrammarError, match="the JSON schema cannot be enforced: keyword x ignored"):
        Grammar.json_schema({"type": "object"})


def test_schemas_that_are_enforced_are_accepted():
    """What the refusals above must not catch: a property named minProperties, minProperties 1,
    a oneOf of disjoint branches, formats llguidance implements, annotations."""
    for schema in ({"type": "object", "properties": {"minProperties": {"type": "integer"}}},
                   {"type": "object", "minProperties": 1}, {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                   {"type": "string", "format": "date-time"}, True,
                   {"title": "t", "description": "d", "$comment": "c", "examples": [1], "type": "integer"}):
        assert Grammar.json_schema(schema).kind == "JSON schema"


# -- chat ------------------------------------------------------------------------------------------

def test_every_chat_reply_follows_the_schema(smollm):
    from runner.engine.conversation import ChatSession
    schema = SCHEMAS[12][1]
    chat = ChatSession(smollm, 512, SamplingOptions(temperature=1.0, seed=4), SYSTEM, max_reply=MAX_TOKENS,
                       grammar=Grammar.json_schema(schema))
    for question in ("Give me a film.", "Another one, from the eighties.", "And a third."):
        check_json(chat.send(question), schema)
        assert chat.last.stop_reason == "eos"


# -- the command line --------------------------------------------------------------------------------

def ggrun(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=600, check=False)


def test_run_with_a_json_schema_prints_valid_json(smollm_path, tmp_path):
    schema = SCHEMAS[5][1]
    r = ggrun("run", smollm_path, "-sys", SYSTEM, "-p", "Give me a person with an address.", "-j", json.dumps(schema),
              "--temp", "1", "-s", "5", "-n", MAX_TOKENS)
    assert r.returncode == 0, r.stderr
    check_json(r.stdout, schema)
    assert "stop: eos" in r.stderr
    path = tmp_path / "list.gbnf"
    path.write_text('root ::= ("- " [a-z]+ "\\n")+\n')
    r = ggrun("run", smollm_path, "-p", "Three fruits:", "--grammar-file", path, "--temp", "0", "-n", 24, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert regex.fullmatch(r"(?:- [a-z]+\n)+", out["text"], partial=out["stop_reason"] == "length")


@pytest.mark.parametrize("args, message", [
    (("-j", '{"type": "object", "not": {}}'),
     'error: --json-schema: the JSON schema cannot be enforced: Unimplemented keys: ["not"]'),
    (("-j", "{"), "error: --json-schema: the JSON schema is not JSON"),
    (("--grammar", "root ::= undefined"), "error: --grammar: invalid grammar: Rule 'undefined' not found"),
    (("-jf", "/nonexistent/schema.json"), "error: cannot read /nonexistent/schema.json"),
    (("-j", "{}", "--grammar", 'root ::= "a"'), "give one grammar: --grammar and --json-schema are both given"),
])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_bad_grammar_is_one_line_of_error_before_the_model_loads(command, args, message, tmp_path):
    """Checked before the model is resolved (the missing model file is never reached)."""
    from click.testing import CliRunner

    from runner.terminal.cli import main
    r = CliRunner().invoke(main, [command, str(tmp_path / "no-such-model.gguf"), *args,
                                  "-p" if command == "run" else "-n", "1"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    assert message in r.stderr.strip().splitlines()[-1]


def _walk(matcher, tok, forced: list[int], decoder) -> SplitReply:
    """Tokens through the matcher: the forced ones, then one of the shortest allowed (the end
    first) until the grammar is complete; what the decoder makes of them."""
    lengths = np.array([len(tok.token_bytes(t)) or 99 for t in range(matcher.size)])
    lengths[[t for t in tok.vocab.end_of_generation if t < matcher.size]] = 0
    rng, reply = np.random.default_rng(0), SplitReply()
    for _ in range(300):
        if matcher.finished:
            return reply
        allowed = np.flatnonzero(matcher.allowed())
        token = forced.pop(0) if forced else int(rng.choice(allowed[lengths[allowed] == lengths[allowed].min()]))
        assert matcher.allowed()[token], tok.token_bytes(token, render_special=True)
        matcher.accept(token)
        reply.add(decoder.part, decoder.push(token))
    pytest.fail("the grammar did not end")


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
         "additionalProperties": False}


def test_a_reasoning_models_thinking_comes_before_the_grammar(smollm, harmony_model):  # noqa: F811
    """A chat reply's grammar applies after the reasoning (reply_grammar): think tags, free text
    inside, then the schema; gpt-oss's analysis message, then the final one holds the schema."""
    from runner.engine.constraint import reply_grammar
    tok = smollm.tokenizer
    grammar = reply_grammar(Grammar.json_schema(POINT), tok.vocab, "think")
    matcher = Matcher(grammar, tok, len(tok.vocab.tokens))
    reply = _walk(matcher, tok, tok.encode("<think>Let me see.</think>\n", add_special=False), ReplyDecoder(tok, None))
    jsonschema.validate(json.loads(reply.answer.split("</think>")[1]), POINT)
    tok = harmony_model.tokenizer
    matcher = Matcher(reply_grammar(Grammar.json_schema(POINT), tok.vocab, "harmony"), tok, len(tok.vocab.tokens))
    analysis = [tok.vocab.tokens.index(t) for t in ("<|channel|>", "analysis", "<|message|>", "\u2581w5", "<|end|>")]
    reply = _walk(matcher, tok, analysis, ReplyDecoder(tok, "harmony"))
    assert reply.reasoning == "w5"
    jsonschema.validate(json.loads(reply.answer), POINT)
    with_no_reasoning = Matcher(reply_grammar(Grammar.json_schema(POINT), tok.vocab, None), tok, len(tok.vocab.tokens))
    assert not with_no_reasoning.allowed()[tok.vocab.tokens.index("<|channel|>")]
