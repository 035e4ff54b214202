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

A chat template comes with the model file and is untrusted. The Jinja sandbox bounds what a
template may touch; ``render`` also bounds what it may cost: the output (``MAX_OUTPUT_CHARS`` plus
``OUTPUT_PER_INPUT_CHAR`` per character of the messages, tools and documents), every string or list
an operator, call or filter makes on the way (the same limit, checked before it is made), the work
(``MAX_STEPS`` operations, calls and lookups) and the time (``MAX_SECONDS``). A template past any of
them, or one that fails in any other way, raises ``ChatTemplateError`` (a ``TokenizerError``, so a
``ValueError``) naming the model file; a message without a role or content raises it before the
template runs, naming the message.

jinja2 is imported on the first render, not before: a cached tokenizer load never needs it.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache, wraps
from typing import Any

from engine.model.tokenizer.errors import TokenizerError

MAX_OUTPUT_CHARS = 8 * 1024 * 1024  # far above any real rendered conversation
OUTPUT_PER_INPUT_CHAR = 4  # a template may repeat each message a few times
MAX_STEPS = 20_000_000  # operations, calls, lookups and output chunks
MAX_SECONDS = 10.0


class ChatTemplateError(TokenizerError):
    """The chat cannot be rendered: a malformed message, or a template that fails or exceeds a limit."""


class _Budget:
    """What one render may still spend; checked by the sandbox on every operation, call and lookup."""

    def __init__(self, source: str, max_chars: int):
        self.source = source
        self.max_chars = max_chars
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            self.refuse(f"it takes more than {MAX_STEPS:,} steps")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            self.refuse(f"it takes more than {MAX_SECONDS:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            self.refuse(f"{what} would exceed {self.max_chars:,} characters")

    def refuse(self, why: str):
        raise ChatTemplateError(f"{self.source}: chat template refused: {why}")


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")
_FORMAT_NUMBER = re.compile(r"(?<=%)[-#0 +]*(\d+)|\{[^{}]*?(\d+)[^{}]*\}")


def render(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None,
    documents: list[dict] | None,
    variables: Mapping[str, Any],
    source: str | None = None,
) -> str:
    """``messages`` rendered with ``template`` and the extra template ``variables``; without a
    template, the message contents joined with ``"\\n"``. ``source`` (the model file) names the
    template in errors."""
    source = source or "the model"
    messages = _normalize_messages(messages, source)
    if template is None:
        return "\n".join(_content_text(m.get("content")) for m in messages)
    input_chars = _size(messages) + _size(tools) + _size(documents)
    budget = _Budget(source, MAX_OUTPUT_CHARS + OUTPUT_PER_INPUT_CHAR * input_chars)
    token = _budget.set(budget)
    try:
        compiled = _compile_template(template)
        chunks, total = [], 0
        for chunk in compiled.generate(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        ):
            total += len(chunk)
            budget.check_size(total, "the rendered chat")
            budget.step()
            # An empty chunk costs a list slot but no characters: a loop printing '' would
            # grow the list to MAX_STEPS entries (150 MiB) inside the size limit.
            if chunk:
                chunks.append(chunk)
        return "".join(chunks)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a template is untrusted: any failure of it is the model's, not ours
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _render_error_type()(f"{source}: chat template failed: {message}") from None
    finally:
        _budget.reset(token)


def _size(value: Any) -> int:
    """The characters of text in ``value`` (strings inside mappings and sequences)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, Sequence):
        return sum(_size(v) for v in value)
    return 0


@lru_cache(maxsize=1)
def _render_error_type() -> type[ChatTemplateError]:
    """``ChatTemplateError`` that is also jinja2's ``TemplateError``, as transformers' callers expect."""
    import jinja2

    class ChatTemplateRenderError(ChatTemplateError, jinja2.exceptions.TemplateError):
        def __str__(self) -> str:
            return ValueError.__str__(self)

    return ChatTemplateRenderError


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_arguments(args: tuple, kwargs: dict, subject: Any = None) -> None:
    """Refuse a call (or filter) whose integer arguments (widths, counts, indents), times the
    largest string or list it is given, or whose format-string widths, exceed the output limit --
    before it makes something that large. ``subject``: the string a method is bound to."""
    budget = _budget.get()
    budget.step()
    values = (*args, *kwargs.values())
    longest = max((_sized(v) or 0 for v in (subject, *values)), default=0)
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            budget.check_size(abs(value) * max(longest, 1), "a call's result")
    if isinstance(subject, str):
        _check_format(subject)


def _check_format(text: str) -> None:
    """Refuse a ``%`` or ``str.format`` string asking for a field wider than the output limit."""
    budget = _budget.get()
    for number in (a or b for a, b in _FORMAT_NUMBER.findall(text)):
        if len(number) > 12 or int(number) > budget.max_chars:
            budget.refuse(f"a format width would exceed {budget.max_chars:,} characters")


def _check_result(value: Any) -> Any:
    size = _sized(value)
    if size is not None:
        _budget.get().check_size(size, "a value")
    return value


def _guarded(name: str, function):
    """``function`` (a filter) with its arguments and result checked against the render's budget."""

    @wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        _check_arguments(args, kwargs)
        if name == "format" and args and isinstance(args[0], str):
            _check_format(args[0])
        return _check_result(function(*args, **kwargs))

    return guarded


@lru_cache(maxsize=1)
def _jinja_env():
    from datetime import datetime

    import jinja2
    import jinja2.compiler
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

    class BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
        @jinja2.compiler.optimizeconst
        def visit_Concat(self, node, frame):  # `a ~ b`, checked like `a + b`
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        # every operator that can make a large value, checked before it does
        intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/"})

        def call_binop(self, context, operator, left, right):
            budget = _budget.get()
            budget.step()
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    size = _sized(seq)
                    if size is not None and isinstance(count, int):
                        budget.check_size(size * count, "a repeated string or list")
            elif operator == "+":
                if _sized(left) is not None and _sized(right) is not None:
                    budget.check_size(_sized(left) + _sized(right), "a joined string or list")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                    budget.check_size(right * abs(left).bit_length() // 8, "a power")
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
            return _check_result(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
            _check_arguments(args, kwargs, getattr(__obj, "__self__", None))
            return _check_result(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):  # `'...'.format(...)`: its widths checked at access
            if isinstance(getattr(value, "__self__", None), str):
                _check_format(value.__self__)
            return super().wrap_str_format(value)

        def checked_concat(self, values):
            budget = _budget.get()
            budget.step()
            parts = [str(value) for value in values]
            budget.check_size(sum(map(len, parts)), "a joined string")
            return "".join(parts)

        def getattr(self, obj, attribute):
            _budget.get().step()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _budget.get().step()
            return super().getitem(obj, argument)

    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    del env.globals["lipsum"]  # makes text of any size; no chat template uses it
    env.filters["tojson"] = tojson
    for name, function in env.filters.items():
        env.filters[name] = _guarded(name, function)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names a template reads from its context (`messages`, `tools`, ...): whether it
    takes tools is whether it reads `tools`. A template that does not parse reads none."""
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_jinja_env().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


@lru_cache(maxsize=16)
def _compile_template(template: str):
    return _jinja_env().from_string(template)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]], source: str) -> list[dict]:
    """Check each message, drop None values and alias reasoning fields, like transformers does
    before rendering."""
    out = []
    for index, message in enumerate(messages):
        problem = _message_problem(message)
        if problem:
            raise ChatTemplateError(f"{source}: chat message {index}: {problem}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _message_problem(message: Any) -> str | None:
    """What is wrong with one chat message: a role that is a non-empty string, and content that is a
    string or a list of ``{"type": ..., "text": ...}`` parts (or absent when it has tool calls)."""
    if not isinstance(message, Mapping):
        return f"must be a dict with 'role' and 'content', got {type(message).__name__}"
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        return f"'role' must be a non-empty string, got {role!r:.40}"
    if content is None:
        return None if message.get("tool_calls") else "has no 'content'"
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list) and all(isinstance(part, Mapping) for part in content):
        texts = [part.get("text") for part in content if part.get("text") is not None]
        if not all(isinstance(text, str) for text in texts):
            return "a content part's 'text' must be a string"
    else:
        return f"'content' must be a string or a list of parts, got {type(content).__name__}"
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"'content' is not valid text (a lone surrogate at character {exc.start})"
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)
