"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them.

Templates are rendered with jinja2 configured like transformers (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, its ``tojson``...), since the templates
shipped with models are written against that environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

from quickdraft.errors import QuickdraftError


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a chat template the way transformers' ``apply_chat_template(tokenize=False)`` does.

    ``variables`` are what transformers passes besides the messages: the special token strings
    (``bos_token``, ``eos_token``...) and any extra template arguments; ``tools`` and
    ``documents`` default to None.
    """
    if not messages:
        raise QuickdraftError("Cannot format an empty conversation; give at least one message.")
    compiled = _compile_template(template)
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    try:
        return str(
            compiled.render(
                messages=_template_messages(messages),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        )
    except QuickdraftError:
        raise
    except Exception as exc:  # any failure inside a template is caused by template or messages
        raise QuickdraftError(
            f"The model's chat template could not format these messages: {exc}. Check the roles "
            "and their order (many templates require user/assistant turns to alternate)."
        ) from exc


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    """Compile once per template; the environment mirrors transformers' sandboxed one."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _safe_namespace_class()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise QuickdraftError(
            f"The model's chat template is not valid jinja (line {exc.lineno}: {exc.message}); "
            "fix the template or use a plain text prompt."
        ) from exc


def _generation_extension() -> Any:
    """transformers' ``{% generation %}`` block tag, rendered as its plain body."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


def _safe_namespace_class() -> type:
    """``namespace`` that refuses underscore names, like transformers' (a sandbox hardening)."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes, got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: plain data, no None values, and
    reasoning available under both ``thinking`` and ``reasoning_content``."""
    result = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise QuickdraftError(
                f"Chat messages must be dicts with role and content, got {message!r}."
            )
        plain = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        result.append(plain)
    return result


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON types only, so the sandbox never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
