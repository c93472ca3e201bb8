"""Tool-call formats (runner/text/tool_calls.py) against the real chat templates of llama.cpp
b11434's models/templates: each family's template is recognised as its format, an assistant's
calls rendered by the template parse back to the same calls, the grammar of each format (auto and
required) lets only its calls through on a real vocabulary (SmolLM2's, tokens sampled at random
under the mask), and a reply that is no valid call stays text."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner.engine.constraint import JSON_OPTIONS, Grammar, Matcher
from runner.text.chat_template import ChatTemplate
from runner.text.tool_calls import FORMATS, Tool, tool_format, writes_calls

jsonschema = pytest.importorskip("jsonschema")

DATA = Path(__file__).parent / "data"

_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
_MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]")
# family: (its template in models/templates, the format it teaches, its control tokens)
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", "hermes", ("<|im_start|>", "<|im_end|>")),
    "qwen3": ("Qwen-Qwen3-0.6B", "hermes", ("<|im_start|>", "<|im_end|>")),
    "hermes3": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", ("<|im_start|>", "<|im_end|>")),
    "qwen3.5": ("Qwen3.5-4B", "qwen-xml", ("<|im_start|>", "<|im_end|>")),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct", "llama3",
                 ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
                  "<|eom_id|>")),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", _MISTRAL),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506", "mistral-args",
                          (*_MISTRAL, "[ARGS]", "[CALL_ID]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")),
    "gpt-oss": ("openai-gpt-oss-120b", "harmony", _HARMONY),
    "granite3.3": ("ibm-granite-granite-3.3-2B-Instruct", "granite",
                   ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")),
    "granite4": ("ibm-granite-granite-4.0", "hermes", ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")),
    "glm4.6": ("GLM-4.6", "glm", ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                  "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                  "</arg_value>")),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B", "hermes", ("<|im_start|>", "<|im_end|>")),  # (no tool format: Hermes)
    "gemma4": ("google-gemma-4-31B-it", "gemma4", ("<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                                                   "<|tool>", "<tool|>", "<|tool_response>", "<tool_response|>")),
    "phi-4-mini": ("phi-4-mini-instruct", "phi4-mini", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                        "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>")),
    "seed-oss": ("ByteDance-Seed-OSS", "seed-xml", ("<seed:bos>", "<seed:eos>")),
    "functionary-v3.1": ("meetkai-functionary-medium-v3.1", "function-tag",
                         ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")),
}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"],
    "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [Tool("get_weather", "The weather in a city", WEATHER), Tool("add", "The sum of two numbers", ADD)]
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 40})]


def template_text(llama_cpp_source, family: str) -> str:
    """The family's template: llama.cpp b11434's copy, or this suite's own where it has none."""
    own = DATA / f"{FAMILIES[family][0]}.jinja"
    return (own if own.exists() else llama_cpp_source / "models" / "templates" / own.name).read_text()


def test_every_format_has_a_family():
    assert {fmt().name for _, fmt in FORMATS} <= {f[1] for f in FAMILIES.values()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_templates_calls_parse_back(llama_cpp_source, family):
    """The format recognised in the family's template, and the calls that template writes for an
    assistant message read back by it (one call where the family writes one only)."""
    source = template_text(llama_cpp_source, family)
    fmt, own = tool_format(source)
    assert fmt.name == FAMILIES[family][1] and own == (family != "smollm3")
    template = ChatTemplate(source, family, "<s>", "</s>")
    calls = CALLS if fmt.parallel else CALLS[:1]
    ids = [fmt.new_id() for _ in calls]
    user = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 40?"}]
    tools = [t.as_openai() for t in TOOLS]
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}
    if not writes_calls(source):  # (the template writes no calls: they are written for it, as serve does)
        assistant = {"role": "assistant", "content": fmt.written(assistant["tool_calls"])}
    prompt = template.render(user, True, tools=tools)
    whole = template.render([*user, assistant], False, tools=tools)
    # (where the generation prompt is not the start of the reply's turn, the reply follows its header)
    header = {"gpt-oss": "<|start|>assistant", "gemma4": "<|turn>model\n"}.get(family)
    assert whole.startswith(prompt) or header
    reply = whole[len(prompt):] if whole.startswith(prompt) else whole[whole.rfind(header) + len(header):]
    for end in ("<|im_end|>", "<|eot_id|>", "</s>", "<|end_of_text|>", "<|call|>", "<|end|>", "<seed:eos>", "<|eom_id|>",
                "<|tool_response>"):
        reply = reply.split(end)[0]
    if family == "gpt-oss":  # (the reply decoder gives a call's header so)
        reply = reply.replace("<|channel|>commentary json", "").replace(" to=functions.", "to=functions.")
    content, parsed = fmt.parse(reply, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls, reply
    assert content.replace("<think>", "").replace("</think>", "").strip() == ""  # (an empty reasoning block)


def test_a_reply_that_is_no_valid_call_is_text():
    hermes = tool_format("<tool_call>")[0]
    for text in ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}}\n</tool_call>",  # (bad JSON)
                 "<tool_call>\n{\"name\": \"subtract\", \"arguments\": {}}\n</tool_call>",   # (no such tool)
                 "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}",             # (cut short)
                 "Hello there."):
        assert hermes.parse(text, TOOLS) == (text, [])
    content, calls = hermes.parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                  '</tool_call>', TOOLS)
    assert content == "Let me add." and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    from gguf_io import GGUFFile
    from gguf_io.vocab import read_vocab
    from runner.text.tokenizer import Tokenizer
    return Tokenizer(read_vocab(GGUFFile(smollm_path)))


@pytest.mark.parametrize("name", [fmt().name for _, fmt in FORMATS])
@pytest.mark.parametrize("choice", ["required", "auto", "think"])
def test_the_grammar_lets_only_calls_through(smollm_tokenizer, name, choice):
    """Tokens drawn at random among those the mask allows (in auto mode, the text forced to open a
    call once some text has come) until the grammar is complete: the reply parses into calls whose
    arguments validate against their tool's schema."""
    fmt = next(f() for _, f in FORMATS if f().name == name)
    tok = smollm_tokenizer
    think = choice == "think"  # (required, after a reasoning block)
    choice = "required" if think else choice
    matcher = Matcher(Grammar.lark(fmt.grammar(TOOLS, choice, True, {}, "think" if think else None, JSON_OPTIONS)), tok,
                      len(tok.vocab.tokens))
    rng = np.random.default_rng(sum(map(ord, name + choice)))
    # (harmony's calls come after its header; in auto mode, text then a call's opening)
    if name == "harmony":
        opening = "<|channel|>commentary to=functions."
    else:
        # (Llama 3's call is the whole reply: no text before it)
        opened = "Sure." + fmt.opening if fmt.opening else '{"name'
        opening = ("<think>Hm.</think>\n" if think else "") + (opened if choice == "auto" else "")
    forced = list(tok.encode(opening, add_special=False))
    # (a bias to short replies: among the tokens allowed, one of the shortest, the end counted first)
    lengths = np.array([len(tok.token_bytes(t)) or 99 for t in range(len(tok.vocab.tokens))])
    lengths[list(tok.vocab.end_of_generation)] = 0
    text = b""
    for _ in range(400):
        if matcher.finished:
            break
        allowed = np.flatnonzero(matcher.allowed())
        shortest = allowed[lengths[allowed] == lengths[allowed].min()]
        token = forced.pop(0) if forced else int(rng.choice(shortest))
        assert matcher.allowed()[token]
        matcher.accept(token)
        text += b"" if token in tok.vocab.end_of_generation else tok.token_bytes(token, render_special=True)
    assert matcher.finished, text
    _, calls = fmt.parse(text.decode(), TOOLS)
    assert calls, text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), next(t.parameters for t in TOOLS if t.name == call.name))


NOTE = Tool("note", "Keep a note", {"type": "object", "properties": {"text": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["text"]})


@pytest.mark.parametrize("family", FAMILIES)
def test_each_formats_grammar_holds_with_its_control_tokens(llama_cpp_source, tmp_path, family):
    """With the family's markup as control tokens of the vocabulary (as real files have them), the
    grammar of every choice is one llguidance takes, free strings included (text up to a control
    token is no lazy lexeme)."""
    from gguf_io import GGUFFile
    from gguf_io.vocab import read_vocab
    from runner.text.lark import control_tokens
    from runner.text.tokenizer import Tokenizer

    from .template_models import write_template_model
    source = template_text(llama_cpp_source, family)
    tok = Tokenizer(read_vocab(GGUFFile(write_template_model(tmp_path / "m.gguf", source, FAMILIES[family][2]))))
    fmt = tool_format(source)[0]
    control = control_tokens(tok.vocab, fmt.markup)
    for choice, reasoning in (("auto", None), ("required", None), ("required", "think"), ("auto", "channel")):
        Matcher(Grammar.lark(fmt.grammar([*TOOLS, NOTE], choice, True, control, reasoning, JSON_OPTIONS)), tok,
                len(tok.vocab.tokens))


PYDANTIC = Tool("book", "Book a trip", {
    "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/Unit"},
                   "site": {"type": "string", "pattern": "^https?:\\/\\/[a-z.]+$"},
                   "code": {"type": "string", "pattern": "[0-9]"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "unit", "site", "code"], "additionalProperties": False})
BOOKED = {"city": "ab", "unit": "celsius", "site": "https://a.b", "code": "x7y", "days": 3}  # (in the schema's order)


@pytest.mark.parametrize("name", [fmt().name for _, fmt in FORMATS])
def test_a_call_as_the_family_writes_it_passes_its_grammar(smollm_tokenizer, name):
    """A call written as the format writes it (a Pydantic-style schema: a $ref, a short bounded
    string, a pattern with '/', an unanchored pattern) goes through the required grammar token by
    token, completes it, and parses back to the same arguments."""
    fmt = next(f() for _, f in FORMATS if f().name == name)
    tok = smollm_tokenizer
    matcher = Matcher(Grammar.lark(fmt.grammar([PYDANTIC], "required", False, {}, None, JSON_OPTIONS)), tok,
                      len(tok.vocab.tokens))
    text = fmt.written([{"function": {"name": "book", "arguments": BOOKED}}])
    text = "<|channel|>commentary " + text if name == "harmony" else text
    for token in tok.encode(text, add_special=False):
        assert token in matcher, (text, tok.token_bytes(token))
        matcher.accept(token)
    assert matcher.finished
    _, calls = fmt.parse(text if name != "harmony" else fmt.written([{"function": {"name": "book",
                                                                                    "arguments": BOOKED}}]), [PYDANTIC])
    assert [json.loads(c.arguments) for c in calls] == [BOOKED]


def test_gemma4s_grammar_grows_with_its_members_not_their_subsets():
    many = Tool("many", "", {"type": "object", "properties": {f"p{i:02}": {"type": "integer"} for i in range(40)}})
    lark = tool_format("<|tool_call>call:")[0].grammar([many], "required", False, {}, None, JSON_OPTIONS)
    assert len(lark) < 40_000
    Grammar.lark(lark)
