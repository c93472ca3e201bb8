"""The real chat templates of llama.cpp b11434's models/templates, rendered by ggrun and by
transformers' render_jinja_template on the same conversations (tools, documents and reasoning
included): wherever transformers renders, ggrun renders the same text."""
from __future__ import annotations

import pytest

from runner.text.chat_template import ChatTemplate

transformers_templates = pytest.importorskip("transformers.utils.chat_template_utils")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one turn": dict(messages=[{"role": "user", "content": "Hello!"}]),
    "system and turns": dict(messages=[
        {"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And <b>3+3</b> & 'more'?"}]),
    "tools": dict(tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "It is 21 degrees."}, {"role": "user", "content": "Thanks"}]),
    "documents": dict(documents=[{"title": "Paris", "text": "Paris is the capital of France."}],
                      messages=[{"role": "user", "content": "What is the capital of France?"}]),
    "reasoning": dict(messages=[
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors but 1 and 7."},
        {"role": "user", "content": "And 9?"}]),
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _transformers(source, case):
    rendered, _ = transformers_templates.render_jinja_template(
        conversations=[case["messages"]], chat_template=source, tools=case.get("tools"),
        documents=case.get("documents"), add_generation_prompt=True, **SPECIAL)
    return rendered[0]


def test_real_templates_render_as_in_transformers(llama_cpp_source):
    paths = sorted((llama_cpp_source / "models" / "templates").glob("*.jinja"))
    same, differ, templates = 0, [], set()
    for path in paths:
        source = path.read_text(encoding="utf-8")
        for case_name, case in CONVERSATIONS.items():
            try:
                want = _transformers(source, case)
            except Exception:  # transformers cannot render it either: nothing to compare
                continue
            try:
                got = ChatTemplate(source, path.stem, **SPECIAL).render(
                    case["messages"], add_generation_prompt=True, tools=case.get("tools"),
                    documents=case.get("documents"))
            except Exception as e:
                got = f"<{type(e).__name__}: {e}>"
            if got == want:
                same += 1
                templates.add(path.stem)
            else:
                differ.append(f"{path.stem} / {case_name}: {got[:200]!r}")
    assert differ == []
    assert len(templates) >= 60 and same >= 300, (len(templates), same)  # 70 templates, 328 renders


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "{{ 'x'.ljust(4000000000) }}", "{{ 'ab'.replace('', 'x' * 1000000) }}", "{{ '%999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}", "{{ 'x' | center(4000000000) }}", "{{ range(100000) | join('x' * 100) }}",
    "{{ 'x\\n' * 100000 | indent(100000) }}", "{{ 'a' * 1000 | replace('a', 'b' * 10000) }}",
])
def test_hostile_templates_stop_within_bounds(source):
    import resource
    import time

    from runner.text.chat_template import ChatTemplateError
    start, rss = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, "hostile").render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert time.monotonic() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 700 << 10  # KiB


def test_a_long_but_honest_render_is_not_stopped():
    source = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages = [{"role": "user", "content": "word " * 190}] * 800  # a 190k-token conversation
    text = ChatTemplate(source, "long").render(messages, add_generation_prompt=False)
    assert text == "".join(f"user: {m['content']}\n" for m in messages)


def test_gemma4s_thought_channel_comes_apart_and_a_grammar_follows_it(llama_cpp_source, tmp_path):
    """Gemma 4 marks its thinking `<|channel>thought\\n...<channel|>` (its template writes it so):
    the reply decoder gives that as reasoning, the channel's name dropped, and a chat reply's
    grammar applies after it."""
    from gguf_io import GGUFFile
    from gguf_io.vocab import read_vocab
    from runner.engine.constraint import Grammar, Matcher, reply_grammar
    from runner.text.reasoning import ReplyDecoder, SplitReply, reasoning_format
    from runner.text.tokenizer import Tokenizer

    from .template_models import write_template_model
    template = (llama_cpp_source / "models" / "templates" / "google-gemma-4-31B-it.jinja").read_text()
    path = write_template_model(tmp_path / "gemma4.gguf", template, ("<|turn>", "<turn|>", "<|channel>", "<channel|>"))
    tok = Tokenizer(read_vocab(GGUFFile(path)))
    assert reasoning_format(tok.vocab) == "channel"

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special=False, continuation=True)
    ids = [tok.vocab.tokens.index("<|channel>"), *text("thought\nLet me see."), tok.vocab.tokens.index("<channel|>"),
           *text('{"x": 3}')]
    decoder, reply = ReplyDecoder(tok, "channel"), SplitReply()
    for token in ids:
        reply.add(decoder.part, decoder.push(token))
    assert (reply.reasoning, reply.answer) == ("Let me see.", '{"x": 3}')
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
    matcher = Matcher(reply_grammar(Grammar.json_schema(point), tok.vocab, "channel"), tok, len(tok.vocab.tokens))
    for token in ids:
        assert token in matcher, tok.token_bytes(token, render_special=True)
        matcher.accept(token)
    assert matcher.finished


def test_tojson_writes_a_filters_sequence_as_a_list():
    source = "{{ messages | map(attribute='role') | tojson }} {{ messages | selectattr('role', 'eq', 'x') | tojson }}"
    assert ChatTemplate(source, "map").render([{"role": "user", "content": "hi"}], False) == '["user"] []'
