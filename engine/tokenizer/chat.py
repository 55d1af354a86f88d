"""Chat templates: the model's Jinja template rendered in a sandbox, within a time and size budget.

Templates come from model files, i.e. from strangers, and the GUI renders one on every keystroke. Jinja's immutable
sandbox blocks the routes to Python's internals and the mutation of what is passed in; it does not bound work or
size: a template can loop 10^10 times, recurse, or build gigabytes in one operation (`'x' * 10**9`, `9 ** 10**9`).
So every render here runs under a budget:
- time: a deadline (RENDER_SECONDS), checked at every call, filter, loop step, buffered join and output chunk the
  template makes: unbounded work needs a loop or a recursion, which pass those points, and an operation that could
  run long inside C is priced (next point) before it starts;
- size: the operators (`+ * ** %`, `~`), the calls and the filters that can multiply sizes (str.format, replace,
  join, indent, ...) are priced before they run, every argument and result is measured (a list holding one string
  10^5 times counts 10^5 times: printing it would write all of them), and the output is capped, all at `limit`
  characters (TEXT_LIMIT, or four times the size of the messages when they are larger).
A template that breaks the budget or the sandbox, or does not compile, raises ChatTemplateRefused (one sentence);
the Tokenizer remembers that, so the next keystroke fails at once instead of spending the budget again.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

# Used when a model ships no template; the same ChatML that transformers used as its default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # the fallback needs both as tokens of the vocabulary

RENDER_SECONDS = 1.0  # per render, and per compile of a new template
TEXT_LIMIT = 1_000_000  # characters: the output, and any value built on the way (raised for long messages)
SOURCE_LIMIT = 1_000_000  # characters of template source; real chat templates are a few kB
INT_BITS_LIMIT = 100_000  # bits of an integer an operator may produce (about 30,000 digits)
TOJSON_INDENT_LIMIT = 16
_REFUSED = "the model's chat template was refused: "


class ChatTemplateRefused(ValueError):
    """The chat template broke the sandbox or its budget, or does not compile: it will fail again, whatever the
    messages."""


class _OverBudget(Exception):
    """Raised inside a render; deliberately not a TypeError/LookupError/... that Jinja's own code would catch."""


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` markers and renders their body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateRaised(TemplateError):
    """raise_exception() from the template: it rejects these messages (another conversation may pass)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


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


# ------------------------------------------------------------------------------------------------- budget


@dataclass(slots=True)
class _Budget:
    deadline: float
    limit: int


_local = threading.local()  # the budget of the render running in this thread
_UNBOUNDED = _Budget(float("inf"), TEXT_LIMIT)


def _start(limit: int) -> None:
    _local.budget = _Budget(time.monotonic() + RENDER_SECONDS, limit)


def _stop() -> None:
    _local.budget = None


def _limit() -> int:
    """The current size budget. Where only sizes are checked, the deadline is not: unbounded work needs a loop step or
    a call, and those check it."""
    b = getattr(_local, "budget", None)
    return TEXT_LIMIT if b is None else b.limit


def _check() -> _Budget:
    """The current budget, after checking its deadline."""
    b = getattr(_local, "budget", None) or _UNBOUNDED
    if time.monotonic() > b.deadline:
        raise _OverBudget(f"it ran past its time budget ({RENDER_SECONDS:g} s)")
    return b


_TEXT = (str, bytes, bytearray)
_SEQUENCES = (str, bytes, list, tuple)
_ITEMS = (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))
_PLAIN = frozenset({str, bytes, int, float, bool, type(None), list, tuple, dict, set, frozenset})


def _size(value: Any, limit: int) -> int:
    """About how many characters `value` stands for when written out: strings, numbers and containers with all they
    hold, an item counted each time it occurs (so a cycle or a list repeating one string is as large as it prints).
    Counting stops once past `limit`."""
    if type(value) is str:  # the common case, first
        return len(value) + 1
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        total += 1
        if isinstance(v, _TEXT):
            total += len(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3  # about its decimal digits
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, _ITEMS):
            stack.extend(v)
        if total > limit:
            break
    return total


def _refuse_size(estimate: int, limit: int) -> None:
    if estimate > limit:
        raise _OverBudget(f"it would build a value of about {estimate:,} characters (its budget is {limit:,})")


def _measured(value: Any, limit: int) -> Any:
    _refuse_size(_size(value, limit), limit)
    return value


def _bounded(iterable: Iterable[Any], b: _Budget, lazy: bool) -> Iterator[Any]:
    """`iterable` with the deadline checked at every item; for an iterator whose items are made as it goes (not a
    container that already holds them), their total size is held to the budget too (something may keep them all)."""
    total = 0
    for item in iterable:
        if time.monotonic() > b.deadline:
            raise _OverBudget(f"it ran past its time budget ({RENDER_SECONDS:g} s)")
        if lazy:
            total += _size(item, b.limit)
            _refuse_size(total, b.limit)
        yield item


def _lazy(value: Any) -> bool:
    """An iterator (a generator, map, ...): its items are made as it is read."""
    return type(value) not in _PLAIN and hasattr(value, "__next__")


@pass_context
def _loop_guard(context: Any, iterable: Any) -> Iterator[Any]:
    """Wrapped around the iterable of every `{% for %}` (pass_context: never folded at compile time)."""
    return _bounded(iterable, _check(), _lazy(iterable))


_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


def _price_format(fmt: str | bytes, values: Iterable[Any], ints_are_widths: bool, limit: int) -> None:
    """`fmt % values` or `fmt.format(*values)`: every field could hold the largest value, padded to the widest
    width written in the format (or passed as an argument, for `%*d` and `{:{}}`)."""
    text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    values = list(values)
    width = max((int(d) if len(d) < 10 else 10**10 for d in _DIGITS.findall(text)), default=0)
    if ints_are_widths:
        width = max([width, *(abs(v) for v in values if isinstance(v, int))])
    largest = max((_size(v, limit) for v in values), default=0)
    fields = text.count("%") + text.count("{")
    _refuse_size(len(text) + fields * (largest + width), limit)


def _price_binop(operator: str, left: Any, right: Any, limit: int) -> None:
    seqs = _SEQUENCES
    if operator == "*":
        if isinstance(left, int) and isinstance(right, seqs):
            left, right = right, left
        if isinstance(left, seqs) and isinstance(right, int):
            _refuse_size(_size(left, limit) * max(right, 0), limit)
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > INT_BITS_LIMIT:
                raise _OverBudget(f"it would compute an integer of over {INT_BITS_LIMIT:,} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > INT_BITS_LIMIT:
                raise _OverBudget(f"it would compute an integer of over {INT_BITS_LIMIT:,} bits")
    elif operator == "+":
        if isinstance(left, seqs) and isinstance(right, seqs):
            _refuse_size(_size(left, limit) + _size(right, limit), limit)
    elif operator == "%" and isinstance(left, (str, bytes)):
        values = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else [right]
        _price_format(left, values, "*" in str(left), limit)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _price_replace(s: Any, old: Any, new: Any, count: Any, limit: int) -> None:
    if not isinstance(s, str | bytes):
        s = str(s)
    if isinstance(old, type(s)) and isinstance(new, type(s)):
        found = len(s) + 1 if not old else s.count(old)
        if isinstance(count, int) and count >= 0:
            found = min(found, count)
        _refuse_size(len(s) + found * max(len(new) - len(old), 0), limit)


def _price_join(sep: Any, items: list[Any], limit: int) -> None:
    _refuse_size(sum(_size(i, limit) for i in items) + len(items) * _size(sep, limit), limit)


def _method_of(obj: Any) -> tuple[Any, str]:
    """The object a bound method belongs to, and the method's name (the sandbox hands out str.format wrapped)."""
    obj = getattr(obj, "__wrapped__", obj)
    return getattr(obj, "__self__", None), getattr(obj, "__name__", "")


def _price_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> tuple[Any, ...]:
    """Price a call the template makes; returns the arguments to call with (a join's iterable made a list)."""
    owner, name = _method_of(obj)
    if isinstance(owner, str | bytes):
        if name in ("format", "format_map"):
            values = [*args, *kwargs.values()]
            if name == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            _price_format(owner, values, bool(_NESTED_FIELD.search(str(owner))), limit)
        elif name == "replace" and len(args) >= 2:
            _price_replace(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1), limit)
        elif name == "join" and args:
            items = list(_bounded(args[0], _check(), _lazy(args[0])))
            _price_join(owner, items, limit)
            args = (items, *args[1:])
        elif name == "expandtabs":
            tab = _arg(args, kwargs, 0, "tabsize", 8)
            if isinstance(tab, int):
                _refuse_size(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * tab, limit)
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((_size(v, limit) for v in args[0].values()), default=1)
            _refuse_size(len(owner) * longest, limit)
    elif obj is generate_lorem_ipsum:
        n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
        if isinstance(n, int) and isinstance(most, int):
            _refuse_size(n * most * 12, limit)
    return args


def _price_filter(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> Any:
    """Price a filter before it runs; returns the value to run it on (a join's iterable made a list)."""
    if name == "replace" and len(args) >= 2:
        _price_replace(value, args[0], args[1], _arg(args, kwargs, 2, "count", None), limit)
    elif name == "join":
        value = list(_bounded(value, _check(), _lazy(value)))
        _price_join(_arg(args, kwargs, 0, "d", ""), value, limit)
    elif name == "indent":
        width = _arg(args, kwargs, 0, "width", 4)
        per_line = _size(width, limit) if isinstance(width, str) else width if isinstance(width, int) else 0
        text = str(value)
        _refuse_size(len(text) + (text.count("\n") + 1) * per_line, limit)
    elif name == "wordwrap":
        wrap = _arg(args, kwargs, 2, "wrapstring", "\n")
        _refuse_size(len(str(value)) * (1 + _size(wrap, limit)), limit)
    elif name == "format" and isinstance(value, str):
        _price_format(value, [*args, *kwargs.values()], "*" in value, limit)
    elif name == "tojson":
        indent = _arg(args, kwargs, 1, "indent", None)
        if isinstance(indent, int) and indent > TOJSON_INDENT_LIMIT:
            raise _OverBudget(f"it asked tojson for an indent of {indent} (at most {TOJSON_INDENT_LIMIT})")
    elif name == "sum":
        start = _arg(args, kwargs, 1, "start", 0)
        if not isinstance(start, int | float):
            # adding sequences one by one copies the sum so far each time: quadratic, inside C
            raise _OverBudget("it sums sequences (only numbers are summed here)")
    return value


def _check_int_args(args: Iterable[Any], limit: int) -> None:
    """A width, count or length argument larger than the budget cannot be meant (ljust, center, to_bytes, ...)."""
    for a in args:
        if isinstance(a, int) and abs(a) > limit:
            raise _OverBudget(f"it passes {a:.3g} as an argument, beyond its budget of {limit:,}")


# Filters that never write their input out as text (they count, pick, convert numbers, sort or regroup): their
# arguments need no measuring here, and what they return is measured where it is written out or joined.
_NON_TEXT_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items", "last",
    "length", "list", "map", "max", "min", "reject", "rejectattr", "reverse", "random", "round", "select",
    "selectattr", "slice", "sort", "unique",
})


def _budgeted_filter(name: str, func: Any) -> Any:
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # the context/environment comes first
    text = name not in _NON_TEXT_FILTERS

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        b = _check()
        head, value, rest = args[:skip], args[skip], args[skip + 1 :]
        _check_int_args((*rest, *kwargs.values()), b.limit)
        if text:
            for a in (value, *rest, *kwargs.values()):
                _measured(a, b.limit)
            value = _price_filter(name, value, rest, kwargs, b.limit)
        if _lazy(value):
            value = _bounded(value, b, True)
        result = func(*head, value, *rest, **kwargs)
        return _measured(result, b.limit) if text else result

    return wrapper


def _finalize(value: Any) -> Any:
    """Every `{{ ... }}` value before it is written out."""
    limit = _limit()
    if type(value) is str:  # the common case, first
        if len(value) > limit:
            _refuse_size(len(value), limit)
        return value
    return _measured(value, limit)


def _budget_concat(parts: Iterable[str]) -> str:
    """environment.concat: joins the output buffered by macros, `{% set %}` blocks, call and filter blocks."""
    b = _check()
    parts = list(parts)
    _refuse_size(sum(len(p) for p in parts), b.limit)
    return "".join(parts)


class _BudgetCodeGenerator(CodeGenerator):
    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        # As Jinja's own, but through environment.budget_join, which measures the parts of `a ~ b ~ ...` first.
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.budget_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    code_generator_class = _BudgetCodeGenerator
    concat = staticmethod(_budget_concat)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # Priced before it runs (the operators that can grow a value), so the result needs no measuring.
        limit = _limit()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, first
            _refuse_size(len(left) + len(right), limit)
            return left + right
        _price_binop(operator, left, right, limit)
        return self.binop_table[operator](left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = _check()
        for a in (*args, *kwargs.values()):
            _measured(a, b.limit)
        owner, name = _method_of(obj)
        if obj is generate_lorem_ipsum or (isinstance(owner, str | bytes | int)
                                           and name not in ("format", "format_map")):
            _check_int_args((*args, *kwargs.values()), b.limit)
        args = _price_call(obj, args, kwargs, b.limit)
        args = tuple(_bounded(a, b, True) if _lazy(a) else a for a in args)
        return _measured(super().call(context, obj, *args, **kwargs), b.limit)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja hands back an Undefined that fails only when used (and prints as ""); refuse at the attempt instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    @staticmethod
    def budget_join(join: Any, parts: tuple[Any, ...]) -> str:
        limit = _limit()
        _refuse_size(sum(_size(p, limit) for p in parts), limit)
        return join(parts)


@functools.lru_cache(maxsize=1)
def _jinja_env() -> _BudgetedEnvironment:
    env = _BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.filters["_loop_guard"] = _loop_guard
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@contextmanager
def _profile_deadline() -> Iterator[None]:
    """Compiling runs Jinja's parser and code generator (Python, no template code): a profile hook on every call
    they make enforces the deadline there."""
    deadline = time.monotonic() + RENDER_SECONDS

    def hook(frame: Any, event: str, arg: Any) -> None:
        if time.monotonic() > deadline:
            raise _OverBudget(f"it took longer than {RENDER_SECONDS:g} s to compile")

    if sys.getprofile() is not None:  # a profiler or debugger is attached: leave it be (and its timing off)
        yield
        return
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    if len(source) > SOURCE_LIMIT:
        raise ChatTemplateRefused(f"{_REFUSED}its {len(source):,} characters are more than {SOURCE_LIMIT:,}")
    env = _jinja_env()
    try:
        _start(TEXT_LIMIT)
        with _profile_deadline():
            tree = env.parse(source)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, "_loop_guard", [], [], None, None, lineno=loop.iter.lineno)
            return env.from_string(tree)
    except _OverBudget as exc:
        raise ChatTemplateRefused(_REFUSED + str(exc)) from None
    except Exception as exc:  # TemplateSyntaxError, or RecursionError / MemoryError on absurd nesting
        raise ChatTemplateRefused(f"{_REFUSED}it does not compile ({_one_line(exc)})") from exc
    finally:
        _stop()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    lineno = getattr(exc, "lineno", None)
    if isinstance(exc, TemplateError) and lineno:
        text += f" (line {lineno})"
    return text if len(text) <= 300 else text[:299] + "…"


def _message_text(messages: Any) -> int:
    """Characters in the messages' string fields: what a long conversation legitimately raises the budget by."""
    if not isinstance(messages, list):
        return 0
    return sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))


def render(source: str, **variables: Any) -> str:
    """Render a chat template with `variables` within the budget.

    Raises ChatTemplateRefused when the template breaks the sandbox or the budget or does not compile (it would
    again, whatever the messages), ValueError when it rejects these messages (its raise_exception).
    """
    template = _compile_template(source)
    limit = max(TEXT_LIMIT, 4 * _message_text(variables.get("messages")))
    _start(limit)
    deadline = _local.budget.deadline
    try:
        out: list[str] = []
        n = 0
        for chunk in template.generate(**variables):
            n += len(chunk)
            if n > limit or time.monotonic() > deadline:
                _refuse_size(n, limit)
                _check()
            out.append(chunk)
        return "".join(out)
    except _OverBudget as exc:
        raise ChatTemplateRefused(_REFUSED + str(exc)) from None
    except _TemplateRaised as exc:
        raise ValueError(f"the model's chat template rejects these messages: {_one_line(exc)}") from exc
    except SecurityError as exc:
        raise ChatTemplateRefused(
            f"{_REFUSED}it attempted an operation the sandbox forbids ({_one_line(exc)})"
        ) from exc
    except RecursionError:
        raise ChatTemplateRefused(f"{_REFUSED}it recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateRefused(f"{_REFUSED}it ran out of memory") from None
    except Exception as exc:
        raise ChatTemplateRefused(f"{_REFUSED}it failed ({type(exc).__name__}: {_one_line(exc)})") from exc
    finally:
        _stop()
