"""The Jinja sandbox that chat templates from model files render in (see chat_template.py)."""
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_template import MAX_OUTPUT


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox blocks attribute access to Python internals; this also bounds string and list
    repetition, the other way a template from a file could exhaust the machine."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise TemplateError("exponent too large in chat template")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
                    raise TemplateError("chat template builds an oversized value")
        return super().call_binop(context, operator, left, right)


def raise_error(message):
    """raise_exception() of Hugging Face templates."""
    raise TemplateError(message)
