"""Chat templates: the model's own (untrusted Jinja from the file, rendered in a sandbox) or a
built-in one for files that have none. Jinja loads with the first template (template_sandbox.py):
commands without one, as `ggrun run`, start without it."""
from __future__ import annotations

import datetime

BUILTIN_TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    # Gemma has no system role: the system text opens the first user turn
    "gemma": ("{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
              "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}{% else %}"
              "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
              "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
              "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
# a vocabulary token that gives the format away, for files without a template
_MARKERS = {"<|im_start|>": "chatml", "<|start_header_id|>": "llama3", "<start_of_turn>": "gemma"}
MAX_OUTPUT = 1 << 20  # characters; a template is not allowed to build anything bigger


class ChatTemplateError(Exception):
    """The template could not be rendered; the message says why."""


class ChatTemplate:
    def __init__(self, source: str, name: str, bos_token: str = "", eos_token: str = ""):
        from .template_sandbox import GuardedEnvironment, TemplateError, raise_error
        self.name = name
        self._env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals.update(raise_exception=raise_error,
                                 strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        try:
            self._template = self._env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the {name} chat template does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from .template_sandbox import TemplateError
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except TemplateError as e:
            raise ChatTemplateError(f"the {self.name} chat template failed: {e}") from None
        except Exception as e:  # a template is code from a file: any failure is the template's
            raise ChatTemplateError(f"the {self.name} chat template failed: {type(e).__name__}: {e}") from None
        if len(text) > MAX_OUTPUT:
            raise ChatTemplateError(f"the {self.name} chat template produced an oversized prompt")
        return text


def builtin_name_for(vocab_tokens) -> str:
    tokens = set(vocab_tokens[:300_000])
    return next((name for marker, name in _MARKERS.items() if marker in tokens), "chatml")


def choose_template(vocab, requested: str | None = None) -> tuple[ChatTemplate, str | None]:
    """The template to use and, when the file's own template was unusable, a warning.

    requested: a built-in name (overrides the file), or None for the file's own template."""
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id >= 0 else ""
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id >= 0 else ""
    fallback = requested or builtin_name_for(vocab.tokens)
    if requested is None and vocab.chat_template:
        try:
            template = ChatTemplate(vocab.chat_template, "model's", bos, eos)
            template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"},
                             {"role": "assistant", "content": "z"}], add_generation_prompt=True)
            return template, None
        except ChatTemplateError as e:
            builtin = ChatTemplate(BUILTIN_TEMPLATES[fallback], fallback, bos, eos)
            return builtin, f"{e}; using the built-in {fallback} template"
    return ChatTemplate(BUILTIN_TEMPLATES[fallback], fallback, bos, eos), None
