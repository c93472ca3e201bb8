"""The `ggrun` command line."""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
from collections import Counter
from dataclasses import replace

import click

from convert.errors import ConversionError
from convert.mixes import COPY, FILE_TYPES, MixOptions
from gguf_io import GGUFError
from gguf_io.quant_types import QUANT_TYPES
from gguf_io.safe_files import OutputError, check_output

from ..engine.backend import DEVICES, BackendError
from ..engine.constraint import Grammar, GrammarError
from ..engine.generate import ModelOutputError, PromptError
from ..engine.kv_cache import DEFAULT_CONTEXT, MIN_CONTEXT, ContextFullError
from ..engine.kv_pool import states_held
from ..engine.load import LoadOptions
from ..engine.memory_fit import MemoryFitError
from ..engine.sampler import OptionError, SamplingOptions
from ..engine.speculative import DRAFT_P_MIN, DraftError, describe_speculation
from ..fetch.registry import DEFAULT_MODEL, RegistryError
from ..serve.options import ServeOptions
from ..text.chat_template import ChatTemplateError
from ..text.user_files import InputError, read_text, user_message

USER_ERRORS = (GGUFError, ContextFullError, RegistryError, ConversionError, ChatTemplateError, BackendError,
               ModelOutputError, PromptError, InputError, DraftError, OutputError, MemoryFitError, GrammarError,
               OSError)
INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)


class Command(click.Command):
    """Turns a user's mistake into one line on stderr and exit status 1; Ctrl-C into exit 130."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            click.echo(f"error: {user_message(e)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(INTERRUPTED)


class Group(click.Group):
    """ggrun's commands. A usage mistake exits with status 1, as llama.cpp's and ollama's do (click's
    own is 2): 1 is every user's error, 130 Ctrl-C."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            status = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            e.show()
            sys.exit(1)
        except click.Abort:
            click.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
        sys.exit(status if isinstance(status, int) else 0)


def _options(*decorators):
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


def _merging(merge, *decorators):
    """Options that a wrapper folds into the command's own arguments (llama.cpp's spellings of them)."""
    def apply(f):
        @functools.wraps(f)
        def wrapper(**kwargs):
            return f(**merge(kwargs))
        return _options(*decorators)(wrapper)
    return apply


def _merge_model(kw):
    model, option, hf = kw.pop("model"), kw.pop("model_opt"), kw.pop("hf_repo")
    if hf is not None:
        from ..fetch.hub import parse_hub_name
        hub = parse_hub_name(hf)
        if hub is None:
            raise click.BadParameter(f"{hf!r} is not USER/REPO[:TAG]", param_hint="-hf")
        hf = hub.name
    given = list(dict.fromkeys(m for m in (model, option, hf) if m))
    if len(given) > 1:
        raise click.UsageError(f"two models given: {given[0]!r} and {given[1]!r}")
    return {**kw, "model": given[0] if given else None}


def _merge_kv_type(kw):
    given = {t for t in (kw.pop("ctk"), kw.pop("ctv")) if t}
    if len(given) > 1:
        raise click.UsageError("ggrun keeps keys and values in one type: give -ctk and -ctv the same one")
    return {**kw, "kv_type": given.pop() if given else kw["kv_type"]}


def _merge_ngl(kw):
    ngl = kw.pop("n_gpu_layers")
    if ngl is not None:  # llama.cpp's layer count: ggrun offloads all layers or none
        kw["device"] = "cuda" if ngl != 0 else "cpu"
    return kw


model_argument = _merging(_merge_model, click.argument("model", required=False),
                          click.option("-m", "--model", "model_opt", metavar="MODEL",
                                       help="The model, as llama.cpp's -m (or give it as the argument): a GGUF "
                                            "file (any part of a split one), a registry name or hf.co/USER/REPO"
                                            f"[:TAG]; omitted: {DEFAULT_MODEL}, downloaded on first use."),
                          click.option("-hf", "--hf-repo", "hf_repo", metavar="USER/REPO[:TAG]",
                                       help="A GGUF model on the Hugging Face Hub, as llama.cpp's -hf: TAG picks "
                                            "the quant type (default Q4_K_M, else Q8_0, else the first file); "
                                            "downloaded into the Hugging Face cache once."))

# the sampling options' flags -> SamplingOptions' fields (their defaults are SamplingOptions')
_SAMPLING_FLAGS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_FLAG_OF = {field: "--" + flag.replace("_", "-") for flag, field in _SAMPLING_FLAGS.items()}


def _merge_sampling(kw):
    """The sampling flags as one SamplingOptions, checked as chat's /set and a server check them."""
    given = {field: kw.pop(flag) for flag, field in _SAMPLING_FLAGS.items()}
    try:
        return {**kw, "sampling": SamplingOptions(**{k: v for k, v in given.items() if v is not None})}
    except OptionError as e:
        raise click.BadParameter(e.problem, param_hint=_FLAG_OF[e.option]) from None


_DEFAULT_SAMPLING = SamplingOptions()
sampling_options = _merging(
    _merge_sampling,
    click.option("--temp", type=float, default=_DEFAULT_SAMPLING.temperature, show_default=True,
                 help="Temperature; 0 or less is greedy."),
    click.option("--top-k", type=int, default=_DEFAULT_SAMPLING.top_k, show_default=True, help="0 or less: off."),
    click.option("--top-p", type=click.FloatRange(0, 1), default=_DEFAULT_SAMPLING.top_p, show_default=True,
                 help="1: off."),
    click.option("--min-p", type=click.FloatRange(0, 1), default=_DEFAULT_SAMPLING.min_p, show_default=True,
                 help="0: off."),
    click.option("--repeat-penalty", type=click.FloatRange(0, min_open=True), default=_DEFAULT_SAMPLING.repeat_penalty,
                 show_default=True, help="1: off."),
    click.option("--repeat-last-n", type=click.IntRange(-1), default=_DEFAULT_SAMPLING.repeat_last_n,
                 show_default=True, help="Window of the penalties (-1: all tokens, 0: off)."),
    click.option("--presence-penalty", type=float, default=_DEFAULT_SAMPLING.presence_penalty, show_default=True),
    click.option("--frequency-penalty", type=float, default=_DEFAULT_SAMPLING.frequency_penalty, show_default=True),
    click.option("-s", "--seed", type=click.IntRange(-1), help="Random seed; the same seed gives the same text "
                                                               "(-1 or none: random)."))
_DEFAULT_LOAD = LoadOptions()
threads_option = click.option("-t", "--threads", type=click.IntRange(1), help="CPU threads (default: all cores).")
_kv_types = click.Choice(["f16", "f32", "q8_0"])
_KV_TYPE_OPTIONS = (
    click.option("--cache-type", "--kv-type", "kv_type", default=_DEFAULT_LOAD.kv_type, show_default=True,
                 type=_kv_types, help="KV cache precision (f32: exact, twice the memory; q8_0: 8-bit blocks, "
                                      "about half)."),
    click.option("-ctk", "--cache-type-k", "ctk", type=_kv_types, help="As --cache-type (llama.cpp's spelling)."),
    click.option("-ctv", "--cache-type-v", "ctv", type=_kv_types, help="As --cache-type (llama.cpp's spelling)."))
kv_type_option = _merging(_merge_kv_type, *_KV_TYPE_OPTIONS)


def _merge_load(kw):
    """threads, the KV type and the device options as one LoadOptions (its context set by each
    command)."""
    from ..engine.backend import resolve_device
    kw = _merge_ngl(_merge_kv_type(kw))
    load = LoadOptions(device=resolve_device(kw.pop("device")), threads=kw.pop("threads"), kv_type=kw.pop("kv_type"),
                       precise=kw.pop("precise"))
    return {**kw, "load": load}


load_options = _merging(
    _merge_load, threads_option, *_KV_TYPE_OPTIONS,
    click.option("--device", default="auto", show_default=True, type=click.Choice(DEVICES),
                 help="cpu (Numba), cuda (an NVIDIA GPU through torch), or auto: cuda when "
                      "available. torch-cpu runs the GPU kernels on the CPU (for testing)."),
    click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=click.IntRange(-1),
                 help="llama.cpp's offload count: 0 runs on the CPU, any other value on CUDA (all layers)."),
    click.option("--precise", is_flag=True,
                 help="CPU decode with 16-bit activations (within 0.01% of exact arithmetic) instead of "
                      "llama.cpp's 8-bit ones, the faster default; on CUDA, prefill in float32 instead of TF32."))


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """-p TEXT ('-': stdin), -f FILE, or the text piped in."""
    from ..text.tokenizer import valid_utf8
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt once: -p or -f")
    if prompt_file is not None:
        return read_text(prompt_file)
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return read_text("-")
    if prompt is None:
        raise click.UsageError("no prompt: give -p TEXT, -f FILE or pipe it in")
    return valid_utf8(prompt)


def _system_text(system: str | None, system_file: str | None) -> str | None:
    if system is not None and system_file is not None:
        raise click.UsageError("give the system prompt once: --system-prompt or --system-prompt-file")
    return read_text(system_file) if system_file is not None else system


draft_options = _options(
    click.option("-md", "--draft", "draft", help="Speculative decoding with a draft model of the same vocabulary "
                                                 "(a GGUF path or a registry name), or self:TYPE (e.g. self:Q4_0): "
                                                 "this model's own weights quantized to TYPE, made once and cached."),
    click.option("--lookup", type=click.IntRange(0), default=0,
                 help="Speculative decoding without a second model: draft what followed the last N tokens "
                      "where they occurred before in the prompt or output."),
    click.option("--draft-max", type=click.IntRange(1), default=16, show_default=True,
                 help="Most tokens drafted per target pass (the CPU verifies up to 8 tokens at once: 7 at most)."),
    click.option("--draft-min", type=click.IntRange(0), default=0, show_default=True,
                 help="Fewest tokens drafted per target pass (where a draft is made at all)."),
    click.option("--draft-p-min", type=click.FloatRange(0, 1), default=DRAFT_P_MIN, show_default=True,
                 help="A draft model stops drafting where its top probability falls below this (llama.cpp's "
                      "default is 0.75; ggrun's passes of up to 8 tokens cost little more than one, so longer "
                      "drafts pay: see runner/engine/speculative.py)."))

# the grammar flags (llama.cpp's spellings) -> how each makes a Grammar from its value
_GRAMMAR_FLAGS = {"grammar": ("--grammar", False, Grammar.gbnf), "grammar_file": ("--grammar-file", True, Grammar.gbnf),
                  "json_schema": ("--json-schema", False, Grammar.json_schema),
                  "json_schema_file": ("--json-schema-file", True, Grammar.json_schema)}


def _merge_grammar(kw):
    """The grammar flags as one Grammar (None without one), checked before the model loads."""
    given = [(name, kw.pop(name)) for name in _GRAMMAR_FLAGS]
    given = [(name, value) for name, value in given if value is not None]
    if len(given) > 1:
        raise click.UsageError(f"give one grammar: {_GRAMMAR_FLAGS[given[0][0]][0]} and "
                               f"{_GRAMMAR_FLAGS[given[1][0]][0]} are both given")
    grammar = None
    if given:
        (name, value), = given
        flag, is_file, make = _GRAMMAR_FLAGS[name]
        try:
            grammar = make(read_text(value) if is_file else value)
        except GrammarError as e:
            raise GrammarError(f"{flag}: {e}") from None
    return {**kw, "grammar": grammar}


grammar_options = _merging(
    _merge_grammar,
    click.option("--grammar", metavar="GRAMMAR", help="A GBNF grammar (llama.cpp's) the output must follow, "
                                                      "e.g. 'root ::= \"yes\" | \"no\"'."),
    click.option("--grammar-file", metavar="FNAME", help="Read the grammar from a file (llama.cpp's grammars/ "
                                                         "folder has examples)."),
    click.option("-j", "--json-schema", metavar="SCHEMA",
                 help="A JSON schema (https://json-schema.org/) the output must follow, e.g. '{\"type\": \"object\"}' "
                      "for any JSON object; a keyword that cannot be enforced is refused."),
    click.option("-jf", "--json-schema-file", metavar="FILE", help="Read the JSON schema from a file."))

system_options = _options(
    click.option("-sys", "--system-prompt", "--system", "system", help="System prompt."),
    click.option("--system-prompt-file", "system_file", type=click.Path(dir_okay=False),
                 help="Read the system prompt from a file."))


def _draft_loader(options: LoadOptions):
    """load(path) for make_drafter: a draft model loaded as the target was, each file once."""
    loaded = {}

    def load(path):
        if str(path) not in loaded:
            loaded[str(path)] = _load(str(path), options)
        return loaded[str(path)]
    return load


@click.group(cls=Group)
@click.version_option(package_name="ggrun")
def main():
    """Run GGUF language models locally. MODEL is a .gguf file or a registry name; omitted, it is
    smollm2-135m-instruct, downloaded into the cache on first use."""


def _load(model, options: LoadOptions, times=None, prefill=True):
    """engine.load of a model path or name, saying on stderr when kernels compile and when the
    context is longer than the model was trained on."""
    from ..engine.session import load
    from ..fetch.registry import resolve
    lm = load(resolve(model), options, times, prefill, notify=_say_once)
    warning = lm.context_warning(options.n_ctx or lm.default_context())
    if warning:
        _say_once(f"warning: {warning}")
    return lm


def _check_stops(ctx, param, stops: tuple[str, ...]) -> tuple[str, ...]:
    if "" in stops:
        raise click.BadParameter("an empty stop string would stop before the first token", param_hint="-r")
    return stops


_said = set()  # (each message is said once per process)


def _say_once(message: str):
    if message not in _said:
        _said.add(message)
        click.echo(message, err=True)


@main.command(cls=Command)
@model_argument
@click.option("-p", "--prompt", help="Prompt text; '-' reads it from stdin, as does a pipe without -p.")
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False), help="Read the prompt from a file.")
@system_options
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(0), help="Tokens to generate.")
@sampling_options
@grammar_options
@click.option("-r", "--reverse-prompt", "stops", multiple=True, callback=_check_stops,
              help="Stop once the text contains this (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Go on past end-of-generation tokens.")
@click.option("--special", is_flag=True, help="Special-token text in the prompt becomes those tokens (as llama.cpp "
                                              "parses it); by default a prompt is plain text.")
@click.option("-c", "--ctx-size", type=click.IntRange(MIN_CONTEXT),
              help=f"Context size (default: min(trained, {DEFAULT_CONTEXT})).")
@click.option("--ring/--no-ring", default=True, show_default=True,
              help="Past the context, keep BOS and overwrite the oldest tokens; --no-ring makes that an error.")
@load_options
@draft_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@click.option("--timings", is_flag=True, help="Print where the time before the first token went.")
def run(model, prompt, prompt_file, system, system_file, n_predict, sampling, grammar, stops, ignore_eos, special,
        ctx_size, ring, load, draft, lookup, draft_max, draft_min, draft_p_min, as_json, timings):
    """Complete a prompt with MODEL (a GGUF path or a registry name)."""
    from ..engine.startup import StartupTimes
    times = StartupTimes()
    times.start("interpreter and CLI")
    from ..engine.constraint import reply_grammar
    from ..engine.sampler import Sampler
    from ..engine.session import Session, warm_prefill
    from ..text.reasoning import REASONING, ReplyDecoder, SplitReply, reasoning_format

    prompt = _prompt_text(prompt, prompt_file)
    system = _system_text(system, system_file)
    load = replace(load, n_ctx=ctx_size)
    lm = _load(model, load, times, prefill=False)
    session = Session.new(lm, ctx_size, ring=ring)
    if draft or lookup:
        from ..engine.speculative import make_drafter
        session.drafter = make_drafter(lm, draft, lookup, session.cache.n_ctx, ring, draft_p_min, _draft_loader(load))
        session.draft_max, session.draft_min = draft_max, draft_min
        times.mark("draft")
    ids = session.prompt_ids(prompt, system, special)
    if len(ids) > lm.backend.few_tokens and warm_prefill(lm, load.device, load.kv_type, _say_once):
        times.mark("prefill kernels")
    ids = session.fit(ids, n_predict)
    for notice in session.notices:
        click.echo(f"warning: {notice}", err=True)
    sampler = Sampler(sampling)
    # a chat reply (through the template) of a reasoning model: its reasoning to stderr, the answer to stdout
    reasoning = reasoning_format(lm.tokenizer.vocab) if system is not None else None
    decoder = ReplyDecoder(lm.tokenizer, reasoning)
    grammar = reply_grammar(grammar, lm.tokenizer.vocab, reasoning)  # (after the reasoning, which is free)
    reply, started = SplitReply(), False
    for piece in session.complete(ids, sampler, n_predict, stop_ids=() if ignore_eos else None, stops=stops,
                                  logprobs=as_json, decoder=decoder, grammar=grammar):
        if timings and not started:
            times.mark(f"prompt of {len(ids)} tokens to first token")
            click.echo(times.line(), err=True)
        started = True
        reply.add(decoder.part, piece)
        if not as_json:
            click.echo(piece, nl=False, err=decoder.part == REASONING)
            sys.stdout.flush()
    stats = session.stats
    if as_json:
        click.echo(json.dumps({
            "text": reply.answer, **({"reasoning": reply.reasoning} if decoder.format else {}),
            "prompt_tokens": stats.prompt_tokens, "prompt_ids": ids,
            "generated_tokens": stats.generated_tokens, "token_ids": stats.tokens,
            "token_logprobs": stats.logprobs, "stop_reason": stats.stop_reason,
            "time_to_first_token_s": stats.time_to_first_token_s,
            "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s,
            **(session.speculation.as_dict() if session.drafter else {})}))
    else:
        click.echo()
        click.echo(f"\nprompt: {stats.prompt_tokens} tokens, time to first token {stats.time_to_first_token_s:.3f} s, "
                   f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s "
                   f"({stats.generated_tokens} tokens, stop: {stats.stop_reason})", err=True)
        if session.drafter and timings:
            click.echo(describe_speculation(session.speculation.as_dict()), err=True)
    if stats.stop_reason == "interrupted":
        sys.exit(INTERRUPTED)


@main.command(cls=Command)
@model_argument
@click.argument("text", required=False)
@click.option("-f", "--file", "text_file", type=click.Path(dir_okay=False), help="Tokenize a file's text.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-special", is_flag=True, help="Do not add BOS/EOS.")
@click.option("--no-parse-special", is_flag=True, help="Special-token text stays plain text (llama-tokenize's).")
def tokenize(model, text, text_file, as_json, no_special, no_parse_special):
    """Print the token ids (and pieces) of TEXT (or of -f FILE, or of what is piped in)."""
    from gguf_io import GGUFFile, read_vocab

    from ..fetch.registry import resolve
    from ..text.tokenizer import Tokenizer
    text = _prompt_text(text, text_file)
    tok = Tokenizer(read_vocab(GGUFFile(resolve(model))))
    ids = tok.encode(text, add_special=not no_special, parse_special=not no_parse_special)
    if as_json:
        click.echo(json.dumps({"ids": ids, "pieces": [tok.piece(i) for i in ids]}))
    else:
        for i in ids:
            click.echo(f"{i:>7} {tok.piece(i)!r}")


@main.command(cls=Command)
@model_argument
@click.option("--fit", is_flag=True, help="Show the memory needed for weights and KV cache.")
@click.option("--ctx", type=click.IntRange(1),
              help=f"Context length for --fit (default: min(trained, {DEFAULT_CONTEXT})).")
@click.option("--mem", help="Memory budget for --fit, e.g. 8G: prints the longest context that fits.")
@click.option("--users", default=1, show_default=True, type=click.IntRange(1), help="Concurrent sequences.")
@kv_type_option
def info(model, fit, ctx, mem, users, kv_type):
    """Architecture, hyperparameters, tensor types, size and bits per weight of MODEL."""
    from gguf_io import GGUFFile, read_params

    from ..fetch.registry import resolve
    f = GGUFFile(resolve(model))
    p = read_params(f)
    if fit:
        from ..engine.load import default_context
        _print_fit(f, p, ctx or default_context(p), mem, users, kv_type)
        return
    click.echo(f"file:          {f.path}")
    if len(f.parts) > 1:
        click.echo(f"parts:         {len(f.parts)}: " + ", ".join(p.name for p in f.parts))
    click.echo(f"architecture:  {p.arch}   name: {f.get('general.name', '?')}")
    from ..measure.bench import parameter_counts, weight_bytes_per_token
    total, active = parameter_counts(f, p)
    click.echo(f"size:          {f.size / 2**20:.1f} MiB, {total / 1e6:.1f} M parameters"
               + (f" ({active / 1e6:.1f} M active per token)" if active != total else "")
               + f", {f.bits_per_weight():.2f} bits per weight")
    # (a count that differs by layer, as Gemma 4's: each distinct value, in layer order)
    by_layer = {"n_ff": p.layer_ff, "n_head_kv": p.layer_kv_heads, "head_dim": p.layer_head_dim}
    fields = ["n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "rope_base", "rms_eps",
              "context_length", "vocab_size", "sliding_window"]
    for field in fields + (["n_expert", "n_expert_used", "n_ff_exp"] if p.n_expert else []):
        values = list(dict.fromkeys(by_layer[field](i) for i in range(p.n_layer))) if field in by_layer else []
        shown = "/".join(map(str, values)) + " (by layer)" if len(values) > 1 else getattr(p, field)
        click.echo(f"{field + ':':<15}{shown}")
    if p.n_layer_kv:
        click.echo(f"shared KV:     the last {p.n_layer - p.n_layer_kv} layers attend over earlier layers' caches")
    if p.n_embd_per_layer:
        click.echo(f"per-layer embeddings: {p.n_embd_per_layer} per layer")
    if p.n_expert:
        click.echo(f"decode reads:  {weight_bytes_per_token(f, p) / 2**20:.1f} MiB of weights per token")
    counts = Counter(t.type.name for t in f.tensors.values())
    click.echo("tensors:       " + ", ".join(f"{n} {k}" for k, n in counts.most_common()))


def _print_fit(f, p, n_ctx, mem, users, kv_type):
    from gguf_io import architecture

    from ..engine.load import memory_fit
    from ..engine.memory_fit import parse_size
    architecture(p.arch)
    try:
        budget = parse_size(mem) if mem else None
    except ValueError as e:
        raise InputError(f"--mem: {e}") from None
    fit = memory_fit(f, p, kv_type)
    mib = 2**20
    if p.n_expert:
        from ..measure.bench import parameter_counts, weight_bytes_per_token
        total, active = parameter_counts(f, p)
        click.echo(f"parameters: {total / 1e6:.1f} M, {active / 1e6:.1f} M active per token ({p.n_expert_used} of "
                   f"{p.n_expert} experts); a decode step reads {weight_bytes_per_token(f, p) / mib:.1f} MiB of weights")
    click.echo(f"weights: {fit.weight_bytes / mib:.1f} MiB (" + ", ".join(
        f"{t} {b / mib:.1f}" for t, b in sorted(fit.weight_bytes_by_type.items(), key=lambda kv: -kv[1])) + ")")
    windows = list(fit.layer_windows.values())
    if not windows:
        click.echo("KV cache: none (no layer attends)")
    else:
        click.echo(f"KV cache ({kv_type}): {fit.kv_bytes_per_token_per_layer():.0f} bytes per token per layer, "
                   f"{fit.kv_bytes_per_token() / 1024:.1f} KiB per token over {windows.count(0)} global layers"
                   + (f"; {len(windows) - windows.count(0)} layers capped at their "
                      f"{'/'.join(map(str, sorted(set(windows) - {0})))}-token window" if any(windows) else ""))
    if fit.state_bytes:
        click.echo(f"recurrent state: {fit.state_bytes / mib:.1f} MiB per sequence")
    click.echo(f"context {n_ctx} x {users} user(s): KV {fit.kv_bytes(n_ctx, users) / mib:.1f} MiB, "
               f"total {fit.total_bytes(n_ctx, users) / mib:.1f} MiB")
    if mem:
        best = fit.max_context(budget, users)
        if fit.weight_bytes > budget:
            click.echo(f"does not fit in {budget / mib:.0f} MiB: "
                       f"the weights alone need {fit.weight_bytes / mib:.1f} MiB")
        else:
            click.echo(f"longest context in {budget / mib:.0f} MiB with {users} user(s): {best} tokens"
                       + (" (the trained length)" if best == p.context_length else ""))


@main.command(cls=Command)
@click.argument("name")
def pull(name):
    """Download a model into the cache: a registry name (smollm2-135m-instruct, gemma3-270m) or a
    Hugging Face model, hf.co/USER/REPO[:TAG]. Prints its path."""
    from ..fetch.registry import fetch_named
    click.echo(fetch_named(name))


@main.command("list", cls=Command)
@click.option("--json", "as_json", is_flag=True)
def list_models(as_json):
    """The cached models: name, size, architecture, quant type and where each came from."""
    from ..fetch.model_cache import cached_models
    rows = []
    for m in cached_models():
        arch, quant = m.describe()
        rows.append({"name": m.name, "size_bytes": m.size, "architecture": arch, "quant": quant,
                     "origin": m.origin, "files": [str(p) for p in m.paths]})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    width = max([len(r["name"]) for r in rows] + [4])
    click.echo(f"{'NAME':<{width}}  {'SIZE':>9}  {'ARCH':<10} {'QUANT':<9} ORIGIN")
    for r in rows:
        parts = f" ({len(r['files'])} parts)" if len(r["files"]) > 1 else ""
        click.echo(f"{r['name']:<{width}}  {r['size_bytes'] / 2**20:>5.0f} MiB  {r['architecture']:<10} "
                   f"{r['quant']:<9} {r['origin']}{parts}")


@main.command(cls=Command)
@click.argument("name")
def rm(name):
    """Remove a cached model: NAME as `ggrun list` shows it (hf.co/USER/REPO alone: all of its)."""
    from ..fetch.model_cache import remove
    for removed, size in remove(name):
        click.echo(f"removed {removed} ({size / 2**20:.0f} MiB)")


@main.command(cls=Command)
@model_argument
@click.option("-p", "--n-prompt", default=512, show_default=True, type=click.IntRange(0), help="0: no prefill test.")
@click.option("-n", "--n-gen", default=128, show_default=True, type=click.IntRange(0), help="0: no decode test.")
@click.option("-r", "--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("-d", "--depth", "depths", default="0", show_default=True,
              help="Comma-separated context depths to decode at (llama-bench's -d), e.g. 16,2048.")
@click.option("--concurrency", "concurrency", metavar="N,N,...",
              help="Also decode N sequences at once through continuous batching, e.g. 1,2,4,8: aggregate "
                   "and per-sequence tok/s, each N in turn.")
@load_options
@draft_options
@click.option("--json", "as_json", is_flag=True)
def bench(model, n_prompt, n_gen, repetitions, depths, concurrency, load, draft, lookup, draft_max, draft_min,
          draft_p_min, as_json):
    """Prefill and decode speed, like llama-bench: mean ± std over repetitions after a warm-up.
    Decode rows add the bytes a step reads and the share of the measured memory bandwidth."""
    from ..measure.bench import run_bench
    if not n_prompt and not n_gen:
        raise click.BadParameter("-p 0 and -n 0 leave nothing to measure", param_hint="-p/-n")
    try:
        depths = [int(d) for d in depths.split(",")]
        if min(depths) < 0:
            raise ValueError
    except ValueError:
        raise click.BadParameter("expected comma-separated non-negative integers", param_hint="--depth") from None
    try:
        levels = [int(n) for n in concurrency.split(",")] if concurrency else []
        if levels and min(levels) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter("expected comma-separated positive integers", param_hint="--concurrency") from None
    lm = _load(model, replace(load, n_ctx=max(n_prompt, max(depths) + n_gen + 1, 16)))
    rows = run_bench(lm, n_prompt, n_gen, repetitions, depths)
    speculation = None
    if (draft or lookup) and n_gen:
        from ..engine.speculative import make_drafter
        from ..measure.bench import speculative_row
        load_draft = _draft_loader(load)

        def new_drafter():  # (a fresh drafter, with a fresh cache, per run; the model loaded once)
            return make_drafter(lm, draft, lookup, n_gen + 512, False, draft_p_min, load_draft)
        speculation = speculative_row(lm, new_drafter, n_gen, repetitions, draft_max, draft_min)
    if levels and n_gen:
        from ..measure.bench import concurrency_rows
        batched = concurrency_rows(lm, levels, n_gen, repetitions)
    else:
        batched = []
    if as_json:
        click.echo(json.dumps(rows + ([speculation] if speculation else []) + batched, indent=1))
        return
    if rows:
        click.echo(f"cpu: {rows[0]['cpu']} · decode products: {rows[0]['decode_products']}")
    for r in rows:
        line = (f"{r['model']:<32} {r['quant']:<7} {r['size_mib']:>7.1f} MiB {r['backend']:<7} {r['threads']:>2} thr "
                f"{r['test']:>10}  {r['tok_s_mean']:>7.1f} ± {r['tok_s_std']:.1f} tok/s")
        if r["bandwidth_fraction"] is not None:
            line += (f"  {r['read_mib_per_token']:.0f} MiB/token = {r['bandwidth_fraction']:.2f} of "
                     f"{r['bandwidth_gb_s']:.1f} GB/s")
        click.echo(line)
    if speculation:
        s = speculation
        click.echo(f"{s['test']}: {s['speculative_tok_s']:.1f} tok/s against {s['plain_tok_s']:.1f} plain, "
                   f"{s['speedup']:.2f}x (same process, alternating); {describe_speculation(s)}")
    for r in batched:
        click.echo(f"{r['test']:>10} continuous batching: {r['tok_s_mean']:>7.1f} ± {r['tok_s_std']:.1f} tok/s in all, "
                   f"{r['per_sequence_tok_s']:.1f} per sequence, {r['vs_first_level']:.2f}x {levels[0]} "
                   f"sequence(s)' (levels in turn)")
    compared = [r for r in rows if r["speed_vs_first_depth"] is not None]
    for r in compared[1:]:
        extra = r["read_mib_per_token"] - compared[0]["read_mib_per_token"]
        click.echo(f"decode at depth {r['depth']}: {r['speed_vs_first_depth']:.3f} x the speed at depth "
                   f"{compared[0]['depth']} (single steps alternating between the depths, medians); reading "
                   f"its {extra:.0f} MiB more of KV cache at {r['bandwidth_gb_s']:.1f} GB/s allows at most "
                   f"{r['bandwidth_limit_vs_first_depth']:.3f}")


type_choice = click.Choice(list(FILE_TYPES), case_sensitive=False)


def _split_size(ctx, param, text: str | None) -> int:
    """llama-gguf-split's --split-max-size: N followed by M or G (10^6 or 10^9 bytes); 0: no split."""
    if text is None:
        return 0
    units = {"M": 10**6, "G": 10**9}
    number, unit = text[:-1], text[-1:].upper()
    if unit not in units or not number.isdigit() or int(number) <= 0:
        raise click.BadParameter(f"expected a positive whole number and M or G (e.g. 500M, 2G), not {text!r}")
    return int(number) * units[unit]


def _merge_mix(kw):
    """llama-quantize's mix options as one MixOptions (a type by its name, in any case); the
    importance matrix read once here, so that a file that is not one is a usage error."""
    from gguf import GGMLQuantizationType as T

    from convert.importance import load_importance
    named = {key: None if kw[key] is None else T[kw[key].upper()] for key in ("output_type", "token_embedding_type")}
    weights = {key: tuple(kw[key]) for key in ("include_weights", "exclude_weights")}
    if weights["include_weights"] and weights["exclude_weights"]:
        raise click.UsageError("--include-weights and --exclude-weights cannot be used together")
    mix = MixOptions(pure=kw["pure"], imatrix=kw["imatrix"], **named, **weights)
    try:
        load_importance(mix.imatrix)
    except ConversionError as e:
        raise click.BadParameter(str(e), param_hint="--imatrix") from None
    return {**{k: v for k, v in kw.items() if k not in (*named, *weights, "pure", "imatrix")}, "mix": mix}


_tensor_type = click.Choice(sorted(t.name for t in QUANT_TYPES), case_sensitive=False)
mix_options = _merging(
    _merge_mix,
    click.option("--pure", is_flag=True, help="Every quantized tensor of TYPE's own type (where its rows "
                                              "allow), none promoted, as llama-quantize --pure."),
    click.option("--output-tensor-type", "output_type", type=_tensor_type,
                 help="The output matrix's type (a tied embedding's too), taken as given."),
    click.option("--token-embedding-type", type=_tensor_type, help="The token embedding's type, taken as given."),
    click.option("--imatrix", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                 help="Quantize with this importance matrix (GGUF or legacy .dat, as `ggrun imatrix` and "
                      "llama-imatrix write), as llama-quantize --imatrix."),
    click.option("--include-weights", multiple=True, metavar="NAME",
                 help="Use the importance matrix only for tensors whose names contain NAME (repeatable)."),
    click.option("--exclude-weights", multiple=True, metavar="NAME",
                 help="Do not use the importance matrix for tensors whose names contain NAME (repeatable; not "
                      "with --include-weights)."))
split_option = click.option("--split-max-size", "split_max_size", metavar="N(M|G)", callback=_split_size,
                            help="Write a split model of parts up to this size (as llama-gguf-split names and "
                                 "keys them), e.g. 2G; a model that fits is written whole.")


@main.command(cls=Command)
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="GGUF file to write.")
@click.option("--type", "type_name", default="Q8_0", show_default=True, type=type_choice)
@mix_options
@split_option
def convert(hf_dir, output, type_name, mix, split_max_size):
    """Convert a Hugging Face model folder (safetensors) to a GGUF file of type --type."""
    from pathlib import Path

    from convert.convert import convert_hf
    summary = convert_hf(Path(hf_dir), Path(output), type_name, split_max_size=split_max_size, mix=mix)
    click.echo("\n".join(summary.lines()), err=True)


@main.command(cls=Command)
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.argument("type_name", metavar="TYPE", type=click.Choice([*FILE_TYPES, COPY], case_sensitive=False))
@mix_options
@split_option
def quantize(src, dst, type_name, mix, split_max_size):
    """Requantize an F32/F16/BF16 GGUF file (any part of a split one) to TYPE, as llama-quantize
    does; COPY keeps every tensor as it is (with --split-max-size: split a model)."""
    from pathlib import Path

    from convert.convert import requantize
    summary = requantize(Path(src), Path(dst), type_name, split_max_size=split_max_size, mix=mix)
    click.echo("\n".join(summary.lines()), err=True)


@main.command(cls=Command)
@model_argument
@click.option("-f", "--file", "text_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Text to score.")
@click.option("-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(8))
@click.option("--ring", type=click.IntRange(16), help="Stream the text through a ring of N slots instead of chunks.")
@click.option("-ub", "--ubatch-size", "ubatch", type=click.IntRange(1),
              help="Forward passes of N tokens (default: a chunk at once); up to 8, decode's kernels score the text.")
@click.option("--save-logits", type=click.Path(dir_okay=False), help="Store log-probabilities for --kl-base.")
@click.option("--kl-base", type=click.Path(exists=True, dir_okay=False),
              help="Compare with logits saved from another model with the same tokenizer.")
@load_options
@click.option("--json", "as_json", is_flag=True)
def perplexity(model, text_file, ctx_size, ring, ubatch, save_logits, kl_base, load, as_json):
    """Perplexity of MODEL on a text, computed as llama.cpp's perplexity tool does."""
    from ..fetch.registry import resolve
    from ..measure import perplexity as ppl
    text = read_text(text_file)
    if save_logits:  # (before the work, not after it)
        check_output(save_logits, [resolve(model), text_file, kl_base])
    lm = _load(model, replace(load, n_ctx=ring or ctx_size))
    try:
        base = ppl.load_base(kl_base, len(text.encode("utf-8")) + 1) if kl_base else None
        result = (ppl.ring_perplexity(lm, text, ring, base=base) if ring
                  else ppl.perplexity(lm, text, ctx_size, base=base, ubatch=ubatch))
    except ValueError as e:
        raise InputError(str(e)) from None
    if not math.isfinite(result.ppl):
        raise ModelOutputError(f"the perplexity came out as {result.ppl}: the model computed NaN or infinite "
                               f"log-probabilities (a corrupt file?)")
    if save_logits:
        ppl.save_logits(result, save_logits, len(lm.tokenizer.vocab))
    kl = ppl.compare_to_base(result, base) if base else None
    if as_json:
        click.echo(json.dumps({"model": lm.file.path.name, **result.as_dict(), "kl": kl}))
        return
    how = f"through a ring of {ring}" if ring else f"{result.chunks} chunks of {result.n_ctx}"
    click.echo(f"PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.4f} over {result.tokens_scored} tokens "
               f"({how}), {result.seconds:.1f} s")
    if kl:
        click.echo(f"KLD mean {kl['kld_mean']:.5f}, median {kl['kld_p50']:.5f}, p90 {kl['kld_p90']:.5f}, "
                   f"p99 {kl['kld_p99']:.5f}, max {kl['kld_max']:.5f}")
        click.echo(f"top-1 agreement {100 * kl['top1_agreement']:.2f}%, PPL ratio {kl['ppl_ratio']:.4f} "
                   f"(base PPL {kl['ppl_base']:.4f})")


@main.command(cls=Command)
@model_argument
@click.option("-f", "--file", "text_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Text to collect over.")
@click.option("-o", "--output", default="imatrix.gguf", show_default=True, type=click.Path(dir_okay=False),
              help="GGUF imatrix file to write.")
@click.option("-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(8), help="Tokens per chunk.")
@click.option("--chunks", type=click.IntRange(1), help="Stop after N chunks (default: all the text has).")
@load_options
def imatrix(model, text_file, output, ctx_size, chunks, load):
    """An importance matrix of MODEL over a text, collected as llama-imatrix does: per weight
    matrix input column (and per expert), the squared activations summed and their counts."""
    from gguf_io.imatrix import write_imatrix

    from ..fetch.registry import resolve
    from ..measure.imatrix import ImatrixOptions, collect_imatrix
    text = read_text(text_file)
    check_output(output, [resolve(model), text_file])
    lm = _load(model, replace(load, n_ctx=ctx_size))
    try:
        result, seconds = collect_imatrix(lm, text, ImatrixOptions(n_ctx=ctx_size, chunks=chunks, dataset=text_file))
    except ValueError as e:
        raise InputError(str(e)) from None
    write_imatrix(output, result)
    click.echo(f"{len(result.entries)} matrices over {result.chunk_count} chunks of {ctx_size} tokens, "
               f"{seconds:.1f} s: {output}", err=True)


@main.command("quant-report", cls=Command)
@click.argument("source", type=click.Path(exists=True))
@click.option("-f", "--file", "text_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--types", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q2_K", show_default=True)
@click.option("-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(8))
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False),
              help="An importance matrix: each type it changes is made again with it (and the types that "
                   "need one, with it alone).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Also draw bits per weight vs KLD (PNG).")
@threads_option
@click.option("--json", "as_json", is_flag=True)
def quant_report(source, text_file, types, ctx_size, imatrix, plot_file, threads, as_json):
    """Size, PPL, KLD, top-1 agreement and decode speed per quantization type of SOURCE
    (a Hugging Face folder, or an F32/F16/BF16 GGUF)."""
    from pathlib import Path

    from ..measure.quant_report import format_table, plot
    from ..measure.quant_report import quant_report as report
    names = [t.strip().upper() for t in types.split(",") if t.strip()]
    unknown = [t for t in names if t not in FILE_TYPES]
    if unknown:
        raise click.BadParameter(f"unknown type {unknown[0]}", param_hint="--types")
    text = read_text(text_file)
    if plot_file:  # (before the work, not after it)
        check_output(plot_file, [Path(source), text_file])
    try:
        rows = report(Path(source), text, names, ctx_size, threads, imatrix=Path(imatrix) if imatrix else None)
    except ValueError as e:
        raise InputError(str(e)) from None
    click.echo(json.dumps(rows, indent=1) if as_json else format_table(rows))
    if plot_file:
        try:
            plot(rows, Path(plot_file), Path(source).name)
        except RuntimeError as e:
            raise InputError(str(e)) from None


@main.command(cls=Command)
@model_argument
@system_options
@click.option("-n", "--n-predict", default=-1, show_default=True, type=click.IntRange(-1),
              help="Most tokens per reply; -1: until the model ends it (or Ctrl-C).")
@click.option("-c", "--ctx-size", type=click.IntRange(MIN_CONTEXT),
              help=f"Context size (default: min(trained, {DEFAULT_CONTEXT})).")
@click.option("--chat-template", type=click.Choice(["chatml", "llama3", "gemma"]),
              help="Use a built-in template instead of the file's own.")
@click.option("--save-kv", is_flag=True,
              help="/save also keeps the KV cache (FILE.kv.npz), so /load resumes without prefilling.")
@click.option("--reasoning", type=click.Choice(["show", "hide"]), default="show", show_default=True,
              help="A reasoning model's thinking (gpt-oss's analysis channel, <think> text, Gemma 4's thought "
                   "channel): shown apart from the answer, or hidden.")
@click.option("--tools", "tools_file", metavar="FILE",
              help="Functions the model may call: a JSON list of OpenAI's tools ({\"type\": \"function\", "
                   "\"function\": {name, description, parameters}}) or of the bare functions. They go through "
                   "the chat template; a call's arguments follow its parameters schema, the call is shown and "
                   "you type its result.")
@sampling_options
@grammar_options
@load_options
@draft_options
def chat(model, system, system_file, n_predict, ctx_size, chat_template, save_kv, reasoning, tools_file, sampling,
         grammar, load, draft, lookup, draft_max, draft_min, draft_p_min):
    """Talk with MODEL in the terminal; the context never runs out (ring window)."""
    from ..engine.chat_tools import read_tools
    from ..engine.conversation import ChatSession
    from ..fetch.registry import cache_dir
    from .chat_repl import repl
    system = _system_text(system, system_file)
    tools = None
    if tools_file is not None:
        if grammar is not None:
            raise click.UsageError("give --tools or a grammar (--grammar, --json-schema), not both: with tools a "
                                   "reply follows the tool-call grammar (text, or calls that follow their schemas)")
        try:
            tools = read_tools(tools_file)
        except (InputError, GrammarError) as e:
            raise type(e)(f"--tools: {e}") from None
    load = replace(load, n_ctx=ctx_size)
    lm = _load(model, load)
    n_ctx = ctx_size or lm.default_context()
    drafter = None
    if draft or lookup:
        from ..engine.speculative import make_drafter
        drafter = make_drafter(lm, draft, lookup, n_ctx, True, draft_p_min, _draft_loader(load))
    session = ChatSession(lm, n_ctx, sampling, system, chat_template,
                          max_reply=sys.maxsize if n_predict < 0 else n_predict, save_kv=save_kv, drafter=drafter,
                          draft_max=draft_max, draft_min=draft_min, grammar=grammar, tools=tools)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    repl(session, sys.stdout, cache_dir() / "chat_history", colour=colour, hide_reasoning=reasoning == "hide")


@main.command(cls=Command)
@model_argument
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then set --api-key).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: a free one, which the first log line names).")
@click.option("-np", "--parallel", default=ServeOptions.parallel, show_default=True, type=click.IntRange(1),
              help="Requests that run together, one pass over the weights a step for all of them (continuous "
                   "batching; the CPU takes up to 8 a pass); more wait in the queue.")
@click.option("-c", "--ctx-size", type=click.IntRange(MIN_CONTEXT),
              help="Context of EACH sequence (not divided among the sequences, as llama-server divides it): a "
                   "request's prompt plus max_tokens must fit in it, else it gets a 400. "
                   f"Default: min(trained, {DEFAULT_CONTEXT}).")
@click.option("--kv-size", type=click.IntRange(MIN_CONTEXT),
              help="Tokens of the paged KV cache that the sequences share, in blocks (finished requests' blocks "
                   "stay cached for prefix reuse until needed). A request joins once blocks for its prompt plus "
                   "max_tokens are free. Default: --parallel x -c, so every sequence may fill its context.")
@click.option("--max-queue", default=ServeOptions.max_queue, show_default=True, type=click.IntRange(1),
              help="Requests that may wait to run; more get 503.")
@click.option("--api-key", envvar="GGRUN_API_KEY", show_envvar=True,
              help="Require this key (Authorization: Bearer KEY) on every route but /health and the chat page "
                   "(which asks for the key).")
@click.option("--webui/--no-webui", default=ServeOptions.webui, show_default=True,
              help="Serve the chat page at / (a browser's request; other clients get a plain answer).")
@click.option("-a", "--alias", help="The model's name in the API (default: as given, or its file name).")
@sampling_options
@load_options
@draft_options
def serve(model, host, port, parallel, ctx_size, kv_size, max_queue, api_key, webui, alias, sampling, load, draft,
          lookup, draft_max, draft_min, draft_p_min):
    """Serve MODEL over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) and
    Ollama's (/api/chat, /api/generate, /api/tags, /api/show), plus /health, /props, /metrics,
    /tokenize and /detokenize, and a chat page at / for a browser. The sampling options are the
    defaults that requests override. With --draft or --lookup, speculative decoding runs while one
    request runs alone; several batch instead, which uses the same spare compute. One log line per
    request on stderr; Ctrl-C or SIGTERM cancel what runs and stop."""
    import time
    from pathlib import Path

    from ..fetch.registry import resolve
    from ..serve.model import ModelCard
    from ..serve.server import bind
    from ..serve.server import serve as run_server
    path = Path(resolve(model))
    card = ModelCard.of(model or DEFAULT_MODEL, path, alias)
    sock = bind(host, port)

    def drafter(lm, n_ctx):
        from ..engine.speculative import make_drafter
        return make_drafter(lm, draft, lookup, n_ctx, False, draft_p_min, _draft_loader(load))
    options = ServeOptions(n_ctx=ctx_size, parallel=parallel, kv_size=kv_size, max_queue=max_queue, api_key=api_key,
                           webui=webui, drafter=drafter if draft or lookup else None, draft_max=draft_max,
                           draft_min=draft_min)
    # (the memory check sizes the KV pool, which holds every sequence's tokens, and a hybrid's states)
    sized = replace(load, n_ctx=ctx_size, kv_tokens=kv_size or parallel * (ctx_size or 0) or None,
                    states=states_held(parallel))
    stopped_by = run_server(lambda: _load(str(path), sized), card, sampling, sock, options,
                            lambda line: click.echo(f"{time.strftime('%H:%M:%S')} {line}", err=True))
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    if stopped_by == signal.SIGTERM:
        _terminated(stopped_by, None)


def entry():
    """The `ggrun` command. When Numba first loads a kernel it probes for SciPy's BLAS (to support
    np.dot in jitted code) and imports cffi with its C parser (for cffi functions in jitted code);
    ggrun's kernels use neither, and those imports took 0.3 s and ~50 ms of start-up. A CLI process
    owns its imports, so it skips them (neither torch nor triton imports cffi)."""
    sys.modules.setdefault("scipy.linalg.cython_blas", None)
    sys.modules.setdefault("cffi", None)
    signal.signal(signal.SIGTERM, _terminated)
    main()


def _terminated(signum, frame):
    """SIGTERM ends the command as Ctrl-C does (what it was writing is removed, not left
    half-written), with the shell's status for it."""
    click.echo("\nterminated", err=True)
    raise SystemExit(128 + signum)

