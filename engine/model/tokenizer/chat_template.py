"""Chat templates: a conversation rendered to text, the way transformers renders it.

``Tokenizer.render_chat`` renders the chat template exactly as transformers'
``apply_chat_template`` does (the sandboxed Jinja environment and helpers of its
``chat_template_utils``, with ``bos_token``/``eos_token``/``unk_token``/``pad_token`` as template
variables), and ``Tokenizer.encode_chat`` encodes that text with ``add_special_tokens=False`` --
what ``apply_chat_template(tokenize=True)`` does -- so a template that writes ``{{ bos_token }}``
never gets a second BOS.

A model without a template (e.g. a base GGUF) has ``has_chat_template == False``. ``render_chat``
then falls back to the message contents joined with ``"\\n"`` (no roles, no generation prompt), and
``encode_chat`` encodes that with ``add_special_tokens=True``, so the model's BOS is still added.

jinja2 is imported on the first render, not before: a cached tokenizer load never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any


def render(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None,
    documents: list[dict] | None,
    variables: Mapping[str, Any],
) -> str:
    """``messages`` rendered with ``template`` and the extra template ``variables``; without a
    template, the message contents joined with ``"\\n"``."""
    messages = _normalize_messages(messages)
    if template is None:
        return "\n".join(_content_text(m.get("content")) for m in messages)
    return _compile_template(template).render(
        messages=messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


@lru_cache(maxsize=1)
def _jinja_env():
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks; render it as-is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile_template(template: str):
    return _jinja_env().from_string(template)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Drop None values and alias reasoning fields, like transformers does before rendering."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)
