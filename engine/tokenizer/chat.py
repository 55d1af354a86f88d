"""Chat templates: the model's Jinja template (from a file, i.e. from strangers) rendered in Jinja's immutable
sandbox, with the globals and filters transformers gives templates."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template; the same ChatML that transformers used as its default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # the fallback needs both as tokens of the vocabulary


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` markers and renders their body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, non-ASCII kept; templates rely on that.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Templates come from model files, i.e. from strangers: the sandbox blocks attribute tricks that reach
    # Python internals, and the immutable variant also blocks mutating the objects passed in.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    try:
        return _jinja_env().from_string(source)
    except TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc



def render(source: str, **variables: Any) -> str:
    """Render a chat template with `variables`; ValueError (one sentence) when it fails or breaks the sandbox."""
    template = _compile_template(source)
    try:
        return template.render(**variables)
    except SecurityError as exc:
        raise ValueError(f"chat template attempted an operation the sandbox forbids: {exc}") from exc
    except TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc
