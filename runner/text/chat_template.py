"""Chat templates: the model's own (untrusted Jinja from the file, rendered in a sandbox) or a
built-in one for files that have none. Jinja loads with the first template (template_sandbox.py):
commands without one, as `ggrun run`, start without it."""
from __future__ import annotations

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
        from .template_sandbox import GuardedEnvironment, TemplateError
        self.name = name
        self.builtin = name in BUILTIN_TEMPLATES
        self._env = GuardedEnvironment()
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        try:
            self._template = self._env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the {name} chat template does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None,
               documents: list | None = None, **extra) -> str:
        """The prompt text, with the variables transformers gives a template: messages (a
        message's reasoning also under `reasoning_content` and `thinking`), tools, documents,
        add_generation_prompt, the special tokens and any extra ones (enable_thinking, ...)."""
        from .template_sandbox import TemplateError
        try:
            text = self._env.render_bounded(
                self._template, messages=[_alias_reasoning(m) for m in messages], tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **{**self._special, **extra})
        except TemplateError as e:
            raise ChatTemplateError(f"the {self.name} chat template failed: {e}") from None
        except Exception as e:  # a template is code from a file: any failure is the template's
            raise ChatTemplateError(f"the {self.name} chat template failed: {type(e).__name__}: {e}") from None
        return text


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under the names templates read it by, as transformers passes it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def builtin_name_for(vocab_tokens) -> str:
    tokens = set(vocab_tokens[:300_000])
    return next((name for marker, name in _MARKERS.items() if marker in tokens), "chatml")


def builtin_template(vocab, name: str | None = None) -> ChatTemplate:
    """A built-in template: `name`, or the one whose markers the vocabulary has."""
    name = name or builtin_name_for(vocab.tokens)
    return ChatTemplate(BUILTIN_TEMPLATES[name], name, *_special_texts(vocab))


def _special_texts(vocab) -> tuple[str, str]:
    return (vocab.tokens[vocab.bos_id] if vocab.bos_id >= 0 else "",
            vocab.tokens[vocab.eos_id] if vocab.eos_id >= 0 else "")


def choose_template(vocab, requested: str | None = None) -> tuple[ChatTemplate, str | None]:
    """The template to use and, when the file's own template was unusable, a warning.

    requested: a built-in name (overrides the file), or None for the file's own template."""
    if requested is None and vocab.chat_template:
        try:
            template = ChatTemplate(vocab.chat_template, "model's", *_special_texts(vocab))
            template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"},
                             {"role": "assistant", "content": "z"}], add_generation_prompt=True)
            return template, None
        except ChatTemplateError as e:
            builtin = builtin_template(vocab)
            return builtin, f"{e}; using the built-in {builtin.name} template"
    return builtin_template(vocab, requested), None


def _placeholder(i: int) -> str:
    return f"\ue000{i}\ue001"  # private-use characters: no template trims, splits or matches them


def render_with_content_spans(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool,
                              **variables) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the (start, end) spans in it that are messages' contents, which are
    to be tokenized as plain text: only the template's own markup may yield control tokens.

    The spans come from a second render with each content replaced by a placeholder; when the
    template treats contents as opaque text (the render with the contents put back is the same),
    they are exact. Otherwise (a template that parses contents) each content is looked for in
    order in the text."""
    text = template.render(messages, add_generation_prompt, **variables)
    contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
    marked = [{**m, "content": _placeholder(i)} if contents[i] else m for i, m in enumerate(messages)]
    try:
        skeleton = template.render(marked, add_generation_prompt, **variables)
    except ChatTemplateError:
        skeleton = ""
    rebuilt, spans, pos = "", [], 0  # the skeleton with the contents put back, and where they went
    for i, content in enumerate(contents):
        at = skeleton.find(_placeholder(i), pos) if content else -1
        if at < 0 or skeleton.count(_placeholder(i)) != 1:
            continue
        rebuilt += skeleton[pos:at]
        spans.append((len(rebuilt), len(rebuilt) + len(content)))
        rebuilt += content
        pos = at + len(_placeholder(i))
    if rebuilt + skeleton[pos:] == text and len(spans) == sum(map(bool, contents)):
        return text, spans
    spans, pos = [], 0
    for content in filter(None, contents):
        at = text.find(content, pos)
        if at >= 0:
            spans.append((at, at + len(content)))
            pos = at + len(content)
    return text, spans
