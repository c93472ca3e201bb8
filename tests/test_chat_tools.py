"""ggrun chat --tools: a reply's tool call shown in the REPL, its result typed in and sent back as a
`tool` message, the model going on; the calls and results kept by /save and /load; a template
with a tool format of its own (Qwen 2.5's) given the tools and the calls as it writes them; and a
bad tools file refused in one line before the model loads."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from runner.terminal.cli import main

from .test_chat import PROMPT, start_chat

pexpect = pytest.importorskip("pexpect")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    return path


@pytest.fixture
def home(smollm_path, tmp_path):
    """A cache dir that already holds the default model (a link, nothing downloaded)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / smollm_path.name).symlink_to(smollm_path)
    return tmp_path


def test_a_tool_call_is_shown_its_result_goes_back_and_the_conversation_keeps_both(home, tools_file, tmp_path):
    """SmolLM2's template has no tool format: the tools are described in a system message
    (Hermes), and the model, asked to repeat a call, makes it under the tool-call grammar."""
    child = start_chat("--tools", tools_file, "--temp", "0", "--precise", "-n", "64", env_dir=home,
                       extra_env={"NO_COLOR": "1"})
    lines = ("Repeat exactly: " + CALL).split("\n")
    for line in lines[:-1]:
        child.sendline(line + "\\")  # (a line continued on the next)
    child.sendline(lines[-1])
    child.expect_exact('tool call: get_weather {"city": "Paris"}')
    assert child.before.rsplit("</tool_call>", 1)[1].strip() == ""  # (the call's markup is not shown as text)
    child.expect_exact("get_weather result> ")
    child.sendline("Sunny, 24 C")
    child.expect_exact(PROMPT)
    assert child.before.split("Sunny, 24 C", 1)[1].strip()  # the model went on

    saved = tmp_path / "talk.json"
    child.sendline(f"/save {saved}")
    child.expect_exact(PROMPT)
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    (call,) = messages[1]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "Sunny, 24 C"}
    child.sendline("/clear")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {saved}")
    child.expect_exact(PROMPT)
    assert "loaded 4 messages" in child.before
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def _scripted(monkeypatch, lm, replies: list[str]):
    """The chat's sampler replaced by one that writes the given replies' tokens, one reply a
    sampler (each token one the grammar allows), then the end of the turn."""
    from runner.engine import conversation
    from runner.engine.sampler import Choice
    end = lm.tokenizer.vocab.tokens.index("<|im_end|>")
    script = []

    class Scripted:
        def __init__(self, options):
            script[:] = lm.tokenizer.encode(replies.pop(0), add_special=False) + [end]

        def choose(self, logits, history, allowed=None):
            token = script.pop(0)
            assert allowed is None or token in allowed, lm.tokenizer.piece(token)
            return Choice(token, np.array([token]), np.zeros(1), logits)
    monkeypatch.setattr(conversation, "Sampler", Scripted)


def test_a_template_with_its_own_tool_format_renders_the_tools_the_calls_and_the_results(
        smollm, llama_cpp_source, monkeypatch, tmp_path):
    """Qwen 2.5's template (llama.cpp b11434's copy) on SmolLM2's vocabulary: the tools go to the
    template, a call under the grammar becomes tool_calls (its markup not streamed), the result
    renders as the template's <tool_response>, and the cache keeps what the turns share."""
    from runner.engine.chat_tools import read_tools
    from runner.engine.conversation import ChatSession
    from runner.engine.sampler import SamplingOptions
    qwen = (llama_cpp_source / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    monkeypatch.setattr(smollm.tokenizer.vocab, "chat_template", qwen)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER["function"]]))  # (a bare function)
    session = ChatSession(smollm, 1024, SamplingOptions(temperature=0), max_reply=64, tools=read_tools(str(path)))
    assert session.tools.own and not session.tools.makes_system
    _scripted(monkeypatch, smollm, ["Let me check.\n" + CALL, "It is sunny in Paris."])
    shown = []
    assert session.send("Weather in Paris?", on_text=lambda piece, part: shown.append(piece)) == "Let me check."
    assert "".join(shown) == "Let me check.\n"
    (call,) = session.pending_calls
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    first_turn = session.cache.used
    assert session.send_results(["Sunny, 24 C"]) == "It is sunny in Paris."
    assert session.pending_calls == [] and 0 < session.last.prompt_tokens < first_turn
    text = smollm.tokenizer.decode(session.tokens, render_special=True)
    assert "# Tools" in text and '"name": "get_weather", "description"' in text
    assert ("<|im_start|>assistant\nLet me check.\n" + CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
            "Sunny, 24 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text

    saved = tmp_path / "talk.json"
    session.save(saved)
    resumed = ChatSession(smollm, 1024, SamplingOptions(temperature=0), max_reply=64)  # (no tools: still renders)
    resumed.load(saved)
    assert resumed.messages == session.messages
    data = json.loads(saved.read_text())
    data["messages"][1]["tool_calls"][0]["function"]["arguments"] = "[1]"
    saved.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a conversation"):
        resumed.load(saved)


def test_text_that_only_looks_like_a_call_is_shown_once_the_reply_is_whole():
    from runner.engine.chat_tools import HeldBack
    from runner.text.reasoning import ANSWER, REASONING
    for pieces, has_calls, want in ((["Hi <to", "ol_call>\n{"], True, "Hi "),
                                    (["Hi <to", "day"], False, "Hi <today"),
                                    (["<tool_call", " is a tag"], False, "<tool_call is a tag")):
        shown = []
        stream = HeldBack(lambda piece, part, shown=shown: shown.append((part, piece)), "<tool_call>")
        stream("hmm", REASONING)
        for piece in pieces:
            stream(piece, ANSWER)
        stream.finish(has_calls)
        assert shown[0] == (REASONING, "hmm") and "".join(p for part, p in shown[1:]) == want


@pytest.mark.parametrize("content, problem", [
    (None, "cannot read"),
    ("[{", "is not JSON"),
    ('{"name": "f"}', "must be a JSON list"),
    ('[{"description": "no name"}]', "function 1 has no name"),
    ('[{"type": "function", "function": {"name": "f b"}}]', "'f b' is not 1 to 64 letters"),
    ('[{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nmber"}}}}]',
     "function 'f': invalid JSON schema"),
    ('[{"name": "f", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}]', "cannot be enforced"),
    ('[{"name": "f"}, {"name": "f"}]', "two functions are named 'f'"),
])
def test_a_bad_tools_file_is_one_error_line_before_the_model_loads(tmp_path, content, problem):
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    r = CliRunner().invoke(main, ["chat", "no-such-model", "--tools", str(path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert r.output.startswith("error: --tools: ") and r.output.count("\n") == 1 and problem in r.output, r.output


def test_tools_and_a_grammar_are_refused_together(tools_file):
    for flag in (["--grammar", 'root ::= "yes"'], ["-j", '{"type": "object"}']):
        r = CliRunner().invoke(main, ["chat", "no-such-model", "--tools", str(tools_file), *flag])
        assert r.exit_code == 1 and "give --tools or a grammar" in r.output and "Traceback" not in r.output
