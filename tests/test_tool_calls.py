"""Tool-call formats (runner/text/tool_calls.py) against the real chat templates of llama.cpp
b11434's models/templates: every template is recognised as the format pinned for it, an
assistant's calls rendered by each family's template parse back to the same calls, the grammar of
each format (auto and required) lets only its calls through on a real vocabulary (SmolLM2's,
tokens sampled at random under the mask), and a reply that is no valid call stays text."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from runner.engine.constraint import JSON_OPTIONS, Grammar, Matcher
from runner.text.chat_template import ChatTemplate
from runner.text.tool_calls import FORMATS, Tool, tool_format
from runner.text.tool_messages import template_tools

jsonschema = pytest.importorskip("jsonschema")

DATA = Path(__file__).parent / "data"

_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
_LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
             "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
             "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
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
    "functionary-v3.1": ("meetkai-functionary-medium-v3.1", "function-tag", _LLAMA3),
    "functionary-v3.2": ("meetkai-functionary-medium-v3.2", "functionary-v3.2", _LLAMA3),
    "firefunction-v2": ("fireworks-ai-llama-3-firefunction-v2", "firefunction", _LLAMA3),
    "lfm2": ("LFM2-8B-A1B", "lfm2", ("<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                                     "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                                     "<|tool_response_end|>")),
    "lfm2.5": ("LFM2.5-8B-A1B", "lfm2", ("<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>")),
    "nemotron-nano-v2": ("NVIDIA-Nemotron-Nano-v2", "nemotron", ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
                                                                 "<TOOLCALL>", "</TOOLCALL>", "<AVAILABLE_TOOLS>",
                                                                 "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>",
                                                                 "</TOOL_RESPONSE>")),
    "deepseek-r1": ("llama-cpp-deepseek-r1", "deepseek-r1", _DEEPSEEK),
    # (the distills' templates write calls but never show the tools: they are described in a system message)
    "deepseek-r1-distill-qwen": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-r1", _DEEPSEEK),
    "llm-jp-4.1": ("llm-jp-llm-jp-4.1-8b-thinking", "harmony", _HARMONY),  # (gpt-oss's harmony, spaced)
    "apriel-1.5": ("unsloth-Apriel-1.5", "apriel", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                    "<|tool_result|>", "<|content|>")),
    # (its generation prompt opens the reasoning, which ends at [BEGIN FINAL RESPONSE]: text to ggrun)
    "apriel-1.6": ("Apriel-1.6-15b-Thinker-fixed", "apriel", ("<|begin_system|>", "<|begin_user|>",
                                                              "<|begin_assistant|>", "<|begin_tool_result|>",
                                                              "<|begin_content|>", "<|end|>")),
}
# the format of every template in llama.cpp b11434's models/templates ("-": none, Hermes described), so
# that a new clue that takes an older template away fails; families of architectures ggrun does not
# run are pinned as they fall, right or not
EVERY_TEMPLATE = {
    "hermes": ("Bielik-11B-v3.0-Instruct", "MiMo-VL", "MiniMax-M3", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
               "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct",
               "Qwen-Qwen3-0.6B", "Reka-Edge", "ibm-granite-granite-4.0", "ibm-granite-granite-4.1"),
    "-": ("Apertus-8B-Instruct", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "HuggingFaceTB-SmolLM3-3B",
          "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "MiniMax-M1", "MiniMax-M2", "deepseek-ai-DeepSeek-V3.1",
          "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4",
          "google-gemma-2-2b-it", "llama-cpp-rwkv-world", "microsoft-Phi-3.5-mini-instruct", "moonshotai-Kimi-K2",
          "openbmb-MiniCPM5-1B", "tencent-Hy3", "upstage-Solar-Open-100B"),
    "llama3": ("Cohere2MoE", "CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
               "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct", "muse-glimmer"),
    "glm": ("GLM-4.6", "GLM-4.7-Flash", "Spark2.5", "inclusionai-ling-3.0-flash", "poolside-Laguna-S-2.1",
            "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2"),
    "qwen-xml": ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "Qwen3-Coder", "Qwen3.5-4B", "StepFun3.5-Flash"),
    "mistral-args": ("Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Ministral-3-14B-Reasoning-2512",
                     "unsloth-mistral-Devstral-Small-2507"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407",),
    "harmony": ("openai-gpt-oss-120b", "llm-jp-llm-jp-4.1-8b-thinking"),
    "gemma4": ("google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved"),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct",),
    "seed-xml": ("ByteDance-Seed-OSS",),
    "function-tag": ("meetkai-functionary-medium-v3.1",),
    "functionary-v3.2": ("meetkai-functionary-medium-v3.2",),
    "firefunction": ("fireworks-ai-llama-3-firefunction-v2",),
    "lfm2": ("LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"),
    "nemotron": ("NVIDIA-Nemotron-Nano-v2",),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                    "llama-cpp-deepseek-r1"),
    "apriel": ("unsloth-Apriel-1.5", "Apriel-1.6-15b-Thinker-fixed"),
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


def test_every_template_is_recognised_as_its_format(llama_cpp_source):
    files = sorted((llama_cpp_source / "models" / "templates").glob("*.jinja"))
    expected = {stem: name for name, stems in EVERY_TEMPLATE.items() for stem in stems}
    assert {f.stem for f in files} == set(expected)
    for f in files:
        fmt, own = tool_format(f.read_text())
        assert (fmt.name if own else "-") == expected[f.stem], f.stem


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
    question = "What is the weather in Paris, and what is 2 + 40?"
    user = [{"role": "user", "content": question}]
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}
    # (as serve gives them: the tools, calls written where the template does not write them, ...)
    given = template_tools(source, template)
    messages, variables = given.input(user, TOOLS)
    prompt = template.render(messages, True, **variables)
    whole = template.render(given.input([*user, assistant], TOOLS)[0], False, **variables)
    # (where the generation prompt is not the start of the reply's turn, the reply follows its header)
    header = {"gpt-oss": "<|start|>assistant", "llm-jp-4.1": "<|start|>assistant", "gemma4": "<|turn>model\n",
              "nemotron-nano-v2": "<SPECIAL_11>Assistant\n",
              "apriel-1.6": "<|begin_assistant|>\n"}.get(family, "<｜Assistant｜>")
    assert whole.startswith(prompt) or header in whole
    reply = whole[len(prompt):] if whole.startswith(prompt) else \
        whole[whole.index(header, whole.index(question)) + len(header):]
    for end in ("<|im_end|>", "<|eot_id|>", "</s>", "<|end_of_text|>", "<|call|>", "<|end|>", "<seed:eos>", "<|eom_id|>",
                "<|tool_response>", "<SPECIAL_12>", "<｜end▁of▁sentence｜>"):
        reply = reply.split(end)[0]
    if fmt.name == "harmony":  # (the reply decoder gives a call's header so)
        reply = re.sub(r"<\|channel\|>commentary[^<]*(<\|constrain\|>[^<]*)?", "", reply).replace(" to=", "to=")
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
        # (Llama 3's call is the whole reply: no text before it; Functionary v3.2's text has a recipient)
        opened = fmt.lead + "Sure." + fmt.start if fmt.lead else "Sure." + fmt.opening if fmt.opening else '{"name'
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
    _, calls = fmt.parse(text.decode().split("</think>")[-1], TOOLS)  # (as the reply decoder gives the answer)
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


def test_lfm2_reads_python_and_json_values():
    """LFM2's calls as Python writes them (either quote, True/None) or JSON (true/null), nested; a
    parameter no keyword argument can name is refused (a 400)."""
    lfm2 = tool_format("List of tools: [")[0]
    note = Tool("note", "", {"type": "object", "properties": {}})
    text = ("Noted.<|tool_call_start|>[note(text='it\\'s \"x\"', pin=True, due=None, tags=['a', \"b\"], "
            'meta={"k": [1, 2.5, false, null]}), add(a=-2, b=40)]<|tool_call_end|>')
    content, calls = lfm2.parse(text, [note, *TOOLS])
    assert content == "Noted." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("note", {"text": "it's \"x\"", "pin": True, "due": None, "tags": ["a", "b"],
                  "meta": {"k": [1, 2.5, False, None]}}), ("add", {"a": -2, "b": 40})]
    for bad in ("add(a=1, b=2]", "add(1, 2)]", "subtract(a=1)]"):
        bad = "<|tool_call_start|>[" + bad + "<|tool_call_end|>"
        assert lfm2.parse(bad, TOOLS) == (bad, [])
    odd = Tool("odd", "", {"type": "object", "properties": {"my key": {"type": "string"}}})
    with pytest.raises(ValueError, match="keyword argument"):
        lfm2.grammar([odd], "required", True, {})


def test_functionary_v32s_text_goes_out_without_its_recipient():
    """Functionary v3.2's reply begins after the generation prompt's `>>>`: `all\\n` and text, or a call."""
    fmt = tool_format(">>>all")[0]
    assert fmt.parse("all\nHello.", TOOLS) == ("Hello.", [])
    content, calls = fmt.parse('all\nLet me add.>>>add\n{"a": 1, "b": 2}', TOOLS)
    assert content == "Let me add." and [c.name for c in calls] == ["add"]
    for reply, has_calls, out in (("all\nLet me add.>>>add\n{}", True, "Let me add."),
                                  ("all\nHi >> there", False, "Hi >> there"), ('add\n{"a": 1}', True, ""),
                                  ("all", False, "all")):
        held = fmt.held()
        streamed = "".join(held.push(reply[i:i + 3]) for i in range(0, len(reply), 3))
        assert streamed + held.rest(has_calls) == out, reply


def test_templates_that_take_tools_their_own_way(llama_cpp_source):
    """FireFunction v2's template takes the tools (and the date) in its own variables, tools or none;
    the DeepSeek R1 distills' show no tools, which go in a system message in their call syntax;
    Functionary v3.2's adds a call's arguments to a string: they go to it as JSON text."""
    user = [{"role": "user", "content": "What is 2 + 40?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 40}}}]}

    def rendered(family, messages, tools):
        source = template_text(llama_cpp_source, family)
        template = ChatTemplate(source, family, "<s>", "</s>")
        given = template_tools(source, template)
        messages, variables = given.input(messages, tools)
        return given, template.render(messages, True, **variables)
    given, prompt = rendered("firefunction-v2", user, [])
    assert given.presents and "Available functions as JSON spec:\n[]" in prompt
    assert '"name": "add"' in rendered("firefunction-v2", user, TOOLS)[1]
    given, prompt = rendered("deepseek-r1-distill-qwen", user, TOOLS)
    assert not given.presents and prompt.index('"get_weather"') < prompt.index("What is 2 + 40?")
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" in prompt
    given, prompt = rendered("functionary-v3.2", [*user, call], TOOLS)
    assert given.text_arguments and '>>>add\n{"a": 2, "b": 40}' in prompt
