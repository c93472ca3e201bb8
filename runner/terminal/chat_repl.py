"""The chat REPL around a conversation (engine/conversation.py): slash commands, lines continued
with a backslash, input history, colours on a terminal, Ctrl-C stopping a reply, and a reply's
tool calls shown, their results typed in."""
from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

from gguf_io.safe_files import OutputError

from ..engine.conversation import ChatSession, kv_path
from ..engine.kv_cache import ContextFullError
from ..engine.sampler import OptionError
from ..engine.speculative import describe_speculation
from ..text.chat_template import ChatTemplateError
from ..text.reasoning import REASONING
from ..text.tokenizer import valid_utf8
from ..text.user_files import user_message

HELP = """commands:
  /help                 this help
  /system TEXT          set the system prompt (starts a new conversation)
  /clear                start a new conversation
  /save FILE, /load FILE  keep a conversation, resume it later (with --save-kv: its KV cache
                        too, in FILE.kv.npz, so /load does not prefill it again)
  /set NAME VALUE       temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed (-1: random),
                        presence_penalty, frequency_penalty
  /stats                context use, evictions, last turn's speed, drafts
  /bye                  leave (so do Ctrl-D, and Ctrl-C at the prompt)
end a line with \\ to continue it on the next; Ctrl-C during a reply stops it.
with --tools, a reply's tool call is shown as `tool call: NAME {ARGUMENTS}`: type its result
at the `NAME result>` prompt, and the model goes on."""

# /set's names -> SamplingOptions' fields and how their values are read
SETTABLE = {"temp": ("temperature", float), "temperature": ("temperature", float), "top_k": ("top_k", int),
            "top_p": ("top_p", float), "min_p": ("min_p", float), "repeat_penalty": ("repeat_penalty", float),
            "repeat_last_n": ("repeat_last_n", int), "seed": ("seed", int),
            "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float)}


def format_stats(s: dict) -> str:
    return (f"context {s['context_used']}/{s['context_size']} tokens ({s['pinned']} pinned), "
            f"{s['tokens_evicted']} evicted so far, {s['tokens_total']} processed\n"
            f"last turn: {s['last_prompt_tokens']} prompt tokens prefilled at {s['prefill_tok_s']:.1f} tok/s, "
            f"time to first token {s['time_to_first_token_s']:.3f} s, "
            f"{s['last_generated_tokens']} tokens at {s['decode_tok_s']:.1f} tok/s"
            + ("\n" + describe_speculation(s) if "draft_proposed" in s else ""))


def command(session: ChatSession, line: str, echo) -> bool:
    """Run a slash command; False when the chat should end."""
    name, _, arg = line[1:].partition(" ")
    arg = arg.strip()
    if name in ("bye", "exit", "quit"):
        return False
    if name == "help":
        echo(HELP)
    elif name == "clear":
        session.reset()
        echo("new conversation")
    elif name == "system":
        try:
            session.set_system(arg or None)
            echo("system prompt set; new conversation" if arg else "system prompt cleared; new conversation")
        except ContextFullError as e:
            echo(f"error: {e}; the system prompt stays as it was")
    elif name == "stats":
        echo(format_stats(session.stats()))
    elif name in ("save", "load") and arg:
        try:
            path = Path(arg).expanduser()
            if name == "save":
                session.save(path, with_kv=session.save_kv)
                echo(f"saved {len(session.messages)} messages to {arg}"
                     + (f" and the KV cache to {kv_path(path).name}" if session.save_kv else ""))
            else:
                resumed = session.load(path)
                echo(f"loaded {len(session.messages)} messages from {arg}"
                     + (f" (KV cache from {kv_path(path).name}: nothing prefilled)" if resumed else ""))
        except (OSError, ValueError, ChatTemplateError, ContextFullError, OutputError) as e:
            echo(f"error: {user_message(e)}; the conversation goes on as it was")
    elif name == "set" and arg:
        key, _, value = arg.partition(" ")
        if key not in SETTABLE:
            echo(f"cannot set {key!r}; settable: {', '.join(sorted(SETTABLE))}")
        else:
            field, kind = SETTABLE[key]
            try:
                session.options = replace(session.options, **{field: kind(value.strip())})
                echo(f"{field} = {getattr(session.options, field)}")
            except OptionError as e:
                echo(f"error: {e}; {field} stays {getattr(session.options, field)}")
            except ValueError:
                echo(f"error: {key} needs {'an integer' if kind is int else 'a number'}, not {value.strip()!r}; "
                     f"{field} stays {getattr(session.options, field)}")
    else:
        echo(f"unknown command {line!r}\n{HELP}")
    return True


def read_message(prompt: str = ">>> ", more: str = "... ") -> str:
    """One message from the terminal; lines ending in a backslash continue. Bytes that are not
    UTF-8 become U+FFFD, as llama.cpp reads them."""
    lines = [input(prompt)]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input(more))
    return valid_utf8("\n".join(lines))


HISTORY_LINES = 1000  # lines of input the history file keeps, the newest

# on a terminal: the prompt and the model's text in colour (\001 \002 tell readline what takes no room)
PROMPT_COLOUR, REPLY_COLOUR, THINKING_COLOUR, RESET = "\001\033[1;32m\002", "\033[36m", "\033[2m", "\033[0m"


def repl(session: ChatSession, out, history_file: Path | None = None, colour: bool = False,
         hide_reasoning: bool = False) -> None:
    try:
        import readline  # line editing and history, where the platform has it
        readline.set_history_length(HISTORY_LINES)
        if history_file:
            history_file.parent.mkdir(parents=True, exist_ok=True)
            if history_file.exists():
                readline.read_history_file(history_file)
    except (ImportError, OSError):
        readline = None

    def echo(text):
        out.write(text + "\n")
        out.flush()

    def show_notices():
        for notice in session.notices:
            echo(f"warning: {notice}")
        session.notices.clear()

    thinking = []  # (while a reply's reasoning is shown)

    def show(piece, part):
        """A reply's text as it streams: its reasoning between "Thinking..." and "...done
        thinking." (dimmed on a terminal, as ollama shows it), or not at all (hide_reasoning)."""
        if part == REASONING and hide_reasoning:
            return
        if part == REASONING and not thinking:
            thinking.append(True)
            out.write(f"{THINKING_COLOUR}Thinking...\n" if colour else "Thinking...\n")
        elif part != REASONING and thinking:
            thinking.clear()
            out.write(f"\n...done thinking.\n\n{RESET}{REPLY_COLOUR}" if colour else "\n...done thinking.\n\n")
        out.write(piece)
        out.flush()

    def answer(send, given):
        """The reply to what was given (a message, tool results), streamed by send; Ctrl-C stops it."""
        try:
            # during a reply Ctrl-C only raises a flag that generation checks between tokens
            previous = signal.signal(signal.SIGINT, lambda *_: setattr(session, "interrupted", True))
            try:
                if colour:
                    out.write(REPLY_COLOUR)
                send(given, on_text=show)
            finally:
                signal.signal(signal.SIGINT, previous)
                if colour:
                    out.write(RESET)
        except KeyboardInterrupt:  # pressed as the line was sent, before the flag took over
            session.interrupted = True
        thinking.clear()
        echo("\n[interrupted]" if session.interrupted else "")

    def tool_results() -> list[str] | None:
        """Each pending call shown, its result typed by the user; None where they leave instead
        (Ctrl-D, or Ctrl-C, as at the prompt)."""
        results = []
        for call in session.pending_calls:
            name = call["function"]["name"]
            echo(f"tool call: {name} {call['function']['arguments']}")
            ask = f"{PROMPT_COLOUR}{name} result> \001{RESET}\002" if colour else f"{name} result> "
            try:
                results.append(read_message(ask, more))
            except (EOFError, KeyboardInterrupt):
                echo("")
                return None
        return results

    prompt = f"{PROMPT_COLOUR}>>> \001{RESET}\002" if colour else ">>> "
    more = f"{PROMPT_COLOUR}... \001{RESET}\002" if colour else "... "
    if session.warning:
        echo(f"warning: {session.warning}")
    echo("ggrun chat: /help for commands, /bye to leave")
    try:
        while True:
            show_notices()
            try:
                line = read_message(prompt, more)
            except (EOFError, KeyboardInterrupt):
                echo("")
                break
            if not line.strip():
                continue
            if line.startswith("/"):
                try:
                    if not command(session, line.strip(), echo):
                        break
                except KeyboardInterrupt:  # (a long /load's prefill: the conversation is as it was)
                    echo("\n[interrupted]")
                continue
            answer(session.send, line)
            while session.pending_calls and not session.interrupted:
                results = tool_results()
                if results is None:
                    return
                answer(session.send_results, results)
    finally:
        if readline is not None and history_file:
            try:
                readline.write_history_file(history_file)
            except OSError:
                pass
