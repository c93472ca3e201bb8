"""The Jinja environment that chat templates from model files render in (see chat_template.py).

It offers what transformers' chat templates get (loop controls, the `{% generation %}` tag,
`tojson` with json.dumps' options, `raise_exception`, `strftime_now`), inside Jinja's immutable
sandbox, and bounds what a hostile template can take: every value a concatenation, repetition,
formatting or string method builds is at most MAX_OUTPUT characters, every integer a product or
power makes at most MAX_INT_BITS bits, and a render runs at most
MAX_STEPS template lines (so loops are bounded), RENDER_SECONDS of time and MAX_GROWTH bytes of
new memory."""
from __future__ import annotations

import datetime
import json
import re
import sys
import time
from collections.abc import Iterator

from jinja2 import TemplateError, nodes, pass_eval_context
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from .chat_template import MAX_OUTPUT

MAX_STEPS = 1_000_000        # template lines per render
RENDER_SECONDS = 2.0
MAX_GROWTH = 512 << 20       # bytes of resident memory a render may add
MAX_INT_BITS = 4096          # of an integer a product or power makes: more than any count or index needs
_CHECK_EVERY = 32            # template lines between memory checks
_WIDE_FORMAT = re.compile(r"\d{7,}|\*")  # a field width or precision that could build a huge string


class TemplateLimitError(TemplateError):
    """A render went past one of the sandbox's bounds."""


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


class _Budget:
    """The bounds of one render, enforced by a trace function on the template's own frames."""

    def __init__(self):
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.memory_limit = _resident_bytes() + MAX_GROWTH
        self.steps = 0

    def check_time(self):
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template took longer than {RENDER_SECONDS} s")

    def check_memory(self):
        if _resident_bytes() > self.memory_limit:
            raise TemplateLimitError("the chat template uses too much memory")

    def _line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise TemplateLimitError(f"the chat template ran more than {MAX_STEPS} steps")
            if self.steps % _CHECK_EVERY == 0:
                self.check_memory()
                self.check_time()
        return self._line

    def trace(self, frame, event, arg):
        self.check_time()
        return self._line if frame.f_code.co_filename == "<template>" else None


def _bounded_size(n: int):
    if n > MAX_OUTPUT:
        raise TemplateLimitError("the chat template builds an oversized value")


def _check_int_size(operator: str, left: int, right: int) -> None:
    """Refuses, before it runs, an integer product or power of more than MAX_INT_BITS bits: one
    such operation on huge numbers runs for minutes without returning to the trace function."""
    bits = left.bit_length() * right if operator == "**" else left.bit_length() + right.bit_length()
    if bits > MAX_INT_BITS:
        raise TemplateLimitError("the chat template computes an oversized number")


def _bounded(value):
    if isinstance(value, (str, list, tuple)):
        _bounded_size(len(value))
    return value


def _replaced_size(s: str, old: str, new: str) -> int:
    """The length of s.replace(old, new), before computing it."""
    return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


def _check_format(fmt: str):
    if _WIDE_FORMAT.search(fmt):
        raise TemplateLimitError("the chat template formats with an oversized width")


def _check_str_call(method: str, s: str, args, kwargs):
    """Refuses, before it runs, a str method call whose result would exceed MAX_OUTPUT."""
    if method in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        _bounded_size(args[0])
    elif method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _bounded_size(_replaced_size(s, args[0], args[1]))
    elif method == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        _bounded_size(len(s) * max(int(size), 1) if isinstance(size, int) else len(s))
    elif method in ("format", "format_map"):
        _check_format(s)


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to the environment's bounded concatenation (Jinja joins it unchecked)."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.concat_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' marker of assistant text: renders
    its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(Namespace):
    """namespace() that stores no underscore names, as transformers' (no way into internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"chat templates cannot store {name!r} on a namespace")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: json.dumps without Jinja's HTML escaping, with its options; the
    sequence a filter such as map or select yields (a generator) as a list, as llama.cpp's Jinja
    writes it (its own DeepSeek R1 template asks for `tools | map(attribute='function') | tojson`)."""
    return _bounded(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys, default=_listed))


def _listed(value):
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _bounded_filters(filters) -> dict:
    """join, replace, center, indent and format refusing, before they run, a result over
    MAX_OUTPUT characters."""
    join, replace, center, indent, format_ = (filters[n] for n in ("join", "replace", "center", "indent", "format"))

    @pass_eval_context
    def bounded_join(eval_ctx, value, d="", attribute=None):
        value = list(value)
        if attribute is None:
            _bounded_size(sum(len(str(v)) for v in value) + len(str(d)) * len(value))
        return _bounded(join(eval_ctx, value, d, attribute))

    @pass_eval_context
    def bounded_replace(eval_ctx, s, old, new, count=None):
        s, old, new = str(s), str(old), str(new)
        _bounded_size(_replaced_size(s, old, new))
        return replace(eval_ctx, s, old, new, count)

    def bounded_center(value, width=80):
        _bounded_size(width if isinstance(width, int) else 0)
        return center(value, width)

    def bounded_indent(s, width=4, first=False, blank=False):
        n = width if isinstance(width, int) else len(str(width))
        _bounded_size(len(str(s)) + n * (str(s).count("\n") + 1))
        return indent(s, width, first, blank)

    def bounded_format(value, *args, **kwargs):
        _check_format(str(value))
        return _bounded(format_(value, *args, **kwargs))

    return {"join": bounded_join, "replace": bounded_replace, "center": bounded_center,
            "indent": bounded_indent, "format": bounded_format}


def raise_error(message):
    """raise_exception() of Hugging Face templates."""
    raise TemplateError(message)


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters.update(_bounded_filters(self.filters))
        self.globals.update(raise_exception=raise_error, namespace=_Namespace,
                            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))

    def concat_bounded(self, parts):
        texts = [str(p) for p in parts]
        _bounded_size(sum(map(len, texts)))
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise TemplateLimitError("exponent too large in chat template")
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            _check_int_size(operator, left, right)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _bounded_size(len(seq) * n)
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            _bounded_size(len(left) + len(right))
        if operator == "%" and isinstance(left, str):
            _check_format(left)
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            _check_str_call(getattr(method, "__name__", ""), owner, args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))

    def render_bounded(self, template, **variables) -> str:
        """template.render(**variables) within the bounds above."""
        budget = _Budget()
        previous = sys.gettrace()
        sys.settrace(budget.trace)
        try:
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                _bounded_size(size)
                pieces.append(piece)
            budget.check_memory()
            return "".join(pieces)
        finally:
            sys.settrace(previous)
