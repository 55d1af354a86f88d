"""Chat templates come from model files (strangers) and the GUI renders them on every keystroke: a hostile template
must end in one refusal sentence, in bounded time and memory, and a normal one must render exactly as before.

The hostile cases run in one child process under an address-space limit (RLIMIT_AS) and a hang guard (a
subprocess timeout), so a regression fails the test instead of freezing or exhausting the test machine. A case
passes only when refused for the right reason: an allocation the limit stopped ("ran out of memory") fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.tokenizer import CHATML_TEMPLATE, Tokenizer, chat
from tests.tiny_tokenizer import CHAT_TEMPLATE, IM_END_ID, IM_START_ID, tiny_vocab

ROOT = Path(__file__).resolve().parents[2]

SANDBOX = "sandbox forbids"
TIME = "time budget"
SIZE = "characters (its budget is"
BITS = "bits"
ARGUMENT = "as an argument, beyond its budget"

# (name, template, what the refusal must say)
HOSTILE: list[tuple[str, str, str]] = [
    # escape attempts the sandbox blocks
    ("mro", "{{ ''.__class__.__mro__ }}", SANDBOX),
    ("subclasses", "{{ ''.__class__.__mro__[1].__subclasses__() }}", SANDBOX),
    ("function globals", "{{ messages.__class__.__init__.__globals__ }}", SANDBOX),
    ("cycler globals", "{{ cycler.__init__.__globals__['os'] }}", SANDBOX),
    ("joiner globals", "{{ joiner.__init__.__globals__['os'] }}", SANDBOX),
    ("lipsum globals", "{{ lipsum.__globals__['os'].popen('id').read() }}", SANDBOX),
    ("namespace globals", "{{ namespace.__init__.__globals__ }}", SANDBOX),
    ("template context", "{{ self._TemplateReference__context }}", SANDBOX),
    ("attr filter", "{{ (''|attr('__class__')).__mro__ }}", SANDBOX),
    ("attr filter alone", "{{ ''|attr('__class__') }}", SANDBOX),
    ("str.format field", "{{ '{0.__class__.__mro__}'.format('') }}", SANDBOX),
    ("mutation", "{% set _ = messages.append({'role': 'x'}) %}", SANDBOX),
    ("include", "{% include '/etc/passwd' %}", "it failed"),
    # time
    ("range 10^9", "{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    ("nested loops 10^10", "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TIME),
    ("nested loops over a string", "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
     TIME),
    ("branching recursion", "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
     "{{ f(0) }}", TIME),
    ("recursive macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("power 9 ** 999999999", "{{ 9 ** 999999999 }}", BITS),
    ("big integer product", "{% set n = 2 ** 60000 %}{{ n * n }}", BITS),
    ("sum of lists", "{{ range(100000)|map('string')|map('list')|sum(start=[]) }}", "sums sequences"),
    # size
    ("'x' * 10**9", "{{ 'x' * 10**9 }}", SIZE),
    ("list * 10**9", "{{ [1] * 10**9 }}", SIZE),
    ("doubling by ~", "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
     "{{ ns.s|length }}", SIZE),
    ("doubling by +", "{% macro d(s, n) %}{% if n %}{{ d(s + s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
     "{% endmacro %}{{ d('x', 40) }}", SIZE),
    ("join of repeated refs", "{% set s = 'x' * 500000 %}{{ ([s] * 100000)|join }}", SIZE),
    ("str.join of a generator", "{% set s = 'x' * 500000 %}{{ ''.join(range(100000)|map('replace', '', s)) }}",
     SIZE),
    ("printed list literal", "{% set s = 'x' * 200000 %}{{ [s, s, s, s, s, s, s, s, s, s] }}", SIZE),
    ("block set", "{% set s = 'x' * 500000 %}{% set t %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}"
     "{{ t|length }}", SIZE),
    ("macro output", "{% set s = 'x' * 500000 %}{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}"
     "{% endmacro %}{{ m()|length }}", SIZE),
    ("output stream", "{% for i in range(100000) %}{{ 'x' * 50 }}{% endfor %}", SIZE),
    ("str.format width", "{{ '{:>999999999}'.format(1) }}", SIZE),
    ("str.format repeated field", "{% set s = 'x' * 500000 %}{{ ('{0}' * 10000).format(s) }}", SIZE),
    ("% width", "{{ '%0999999999d' % 1 }}", SIZE),
    ("% star width", "{{ '%*d' % (999999999, 1) }}", SIZE),
    ("format filter", "{{ '%999999999s'|format('x') }}", SIZE),
    ("center", "{{ 'x'|center(999999999) }}", ARGUMENT),
    ("ljust", "{{ 'x'.ljust(999999999) }}", ARGUMENT),
    ("to_bytes", "{{ (1).to_bytes(999999999, 'big') }}", ARGUMENT),
    ("replace empty", "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}", SIZE),
    ("replace filter", "{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", SIZE),
    ("indent", "{{ ('\\n' * 100000)|indent(100000) }}", SIZE),
    ("wordwrap", "{% set s = 'ab ' * 200000 %}{{ s|wordwrap(1, wrapstring=s) }}", SIZE),
    ("expandtabs", "{{ ('\\t' * 100000).expandtabs(100000) }}", SIZE),
    ("translate", "{% set s = 'x' * 100000 %}{{ s.translate({120: s}) }}", SIZE),
    ("dict.fromkeys", "{% set s = 'x' * 100000 %}{{ {}.fromkeys(range(100000), s) }}", SIZE),
    ("lipsum", "{{ lipsum(1000000) }}", SIZE),
    ("tojson indent", "{{ messages|tojson(indent=100) }}", "indent"),
    # compiling
    ("deep nesting", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
    ("huge source", "{# " + "x" * 2_000_000 + " #}", "more than"),
]

CHILD = r"""
import json, os, resource, sys, time

import engine.tokenizer.chat as chat
from engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import tiny_vocab

tokens, merges, types = tiny_vocab(300)
cases = json.loads(sys.stdin.read())
renders = 0
real_render = chat.render

def counting_render(*args, **kwargs):
    global renders
    renders += 1
    return real_render(*args, **kwargs)

chat.render = counting_render
# Enough address space for this process and the budget's values, far too little for what the cases ask for.
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
for name, source in cases:
    tok = Tokenizer.from_vocab(tokens, merges, types, chat_template=source)
    renders = 0
    t0 = time.monotonic()
    try:
        out = tok.chat_prompt("hi")
        kind, message = "rendered", out[:200]
    except ValueError as exc:
        kind, message = type(exc).__name__, str(exc)
    except BaseException as exc:
        kind, message = "crash " + type(exc).__name__, str(exc)[:500]
    seconds = time.monotonic() - t0
    try:
        tok.chat_prompt("hi again")
        again = None
    except ValueError as exc:
        again = str(exc)
    print(json.dumps({"name": name, "kind": kind, "message": message, "seconds": seconds, "again": again,
                      "renders": renders}), flush=True)
"""


@pytest.fixture(scope="module")
def hostile_results() -> dict[str, dict]:
    env = {**__import__("os").environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    try:
        r = subprocess.run(
            [sys.executable, "-c", CHILD],
            input=json.dumps([(name, source) for name, source, _ in HOSTILE]),
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,  # a hang guard, not a speed bound
        )
        stdout, stderr = r.stdout, r.stderr
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = exc.stdout or "", "hung"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    results = {}
    for line in stdout.splitlines():
        row = json.loads(line)
        results[row["name"]] = row
    results["__stderr__"] = {"text": stderr[-3000:] if isinstance(stderr, str) else ""}
    return results


@pytest.mark.parametrize(("name", "source", "reason"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_template_is_refused_in_one_line(hostile_results: dict, name: str, source: str, reason: str) -> None:
    row = hostile_results.get(name)
    assert row is not None, f"no result (the child hung or died): {hostile_results['__stderr__']['text']}"
    message = row["message"]
    assert row["kind"] == "ChatTemplateRefused", row
    assert message.startswith("the model's chat template was refused: ")
    assert reason in message, message
    assert "out of memory" not in message  # stopped by the budget, not by the address-space limit
    assert "\n" not in message and len(message) < 400
    # remembered: the next keystroke fails at once with the same sentence, without rendering again
    assert row["again"] == message
    assert row["renders"] == 1


def _tiny_with(source: str | None) -> Tokenizer:
    tokens, merges, types = tiny_vocab(300)
    return Tokenizer.from_vocab(tokens, merges, types, bos_id=IM_START_ID, eos_ids=[IM_END_ID], chat_template=source)


def test_refusal_is_remembered_and_reported_as_unavailable() -> None:
    tok = _tiny_with("{{ 'x' * 10**9 }}")
    assert tok.chat_unavailable is None  # not known before the first render
    with pytest.raises(chat.ChatTemplateRefused, match="characters") as first:
        tok.chat_prompt("a")
    assert tok.chat_unavailable == str(first.value)
    with pytest.raises(ValueError, match="characters"):
        tok.chat_prompt("b")


def test_a_template_rejecting_messages_is_not_remembered() -> None:
    # raise_exception() depends on the conversation: another one may pass
    tok = _tiny_with("{% if messages[0]['content'] == 'no' %}{{ raise_exception('not this one') }}{% endif %}ok")
    with pytest.raises(ValueError, match="rejects these messages: not this one") as info:
        tok.chat_prompt("no")
    assert not isinstance(info.value, chat.ChatTemplateRefused)
    assert tok.chat_prompt("yes") == "ok"
    assert tok.chat_unavailable is None


def test_long_messages_raise_the_size_budget() -> None:
    text = "word " * 400_000  # 2 MB, twice the fixed budget: a user's long prompt is not a hostile template
    assert _tiny_with(CHAT_TEMPLATE).chat_prompt(text).count("word") == 400_000


# ------------------------------------------------------------------------------------------- normal templates

# A template in the style of current tool-calling chat templates (written for this test): namespace state, a
# reversed walk, string methods, tojson with indent, macros, loop variables, `~`, filters and whitespace control.
TOOL_TEMPLATE = """
{%- macro render_tool(tool) -%}
{{ tool.name }}: {{ tool | tojson(indent=2) }}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content | trim }}{{ '\\n\\n' }}{% endif %}
{{- '# Tools\\n' }}
{%- for tool in tools %}
{{- loop.index ~ '. ' ~ render_tool(tool) ~ '\\n' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1, calls=0) %}
{%- for message in messages[::-1] %}
{%- if ns.last_user < 0 and message.role == 'user' %}{% set ns.last_user = messages|length - 1 - loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
{{- '<|im_start|>assistant\\n' + content }}
{%- if loop.index0 > ns.last_user %}{{ ' [after the last question]' }}{% endif %}
{%- for call in message.tool_calls | default([]) %}
{%- set ns.calls = ns.calls + 1 %}
{{- '\\n<tool_call>\\n{"name": "%s", "arguments": %s}\\n</tool_call>' % (call.name, call.arguments | tojson) }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
{{- '' if ns.calls == 0 else '' }}
"""
TOOL_VARIABLES = {
    "messages": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Weather in Zürich? Use °C."},
        {"role": "assistant", "content": "<think>need the tool</think>\nChecking.",
         "tool_calls": [{"name": "weather", "arguments": {"city": "Zürich", "unit": "C"}}]},
        {"role": "tool", "content": '{"t": 21}'},
    ],
    "tools": [{"name": "weather", "parameters": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}],
    "add_generation_prompt": True,
    "bos_token": "",
    "eos_token": "<|im_end|>",
    "documents": None,
}


def _reference(source: str, variables: dict) -> str:
    """The renderer before the budget: Jinja's immutable sandbox with the same options, globals and tojson."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", chat._GenerationBlock]
    )
    env.filters["tojson"] = chat._tojson
    env.globals["raise_exception"] = chat._raise_exception
    env.globals["strftime_now"] = chat._strftime_now
    return env.from_string(source).render(**variables)


CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? ünïcödé \u2581 {{ not code }}"}],
]


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, CHATML_TEMPLATE, TOOL_TEMPLATE], ids=["smollm2", "chatml", "tools"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_normal_templates_render_as_before(source: str, conversation: int) -> None:
    variables = {**TOOL_VARIABLES, "messages": CONVERSATIONS[conversation], "tools": None}
    assert chat.render(source, **variables) == _reference(source, variables)


def test_tool_template_renders_as_before() -> None:
    expected = _reference(TOOL_TEMPLATE, TOOL_VARIABLES)
    assert '"city": "Zürich"' in expected and "<tool_response>" in expected  # the template's branches ran
    assert chat.render(TOOL_TEMPLATE, **TOOL_VARIABLES) == expected


@pytest.mark.slow
def test_installed_models_render_as_before() -> None:
    from engine.formats.locate import ModelLoadError, default_model_path, gemma3_path

    try:
        smol = Tokenizer.from_gguf(default_model_path())
    except ModelLoadError:
        pytest.skip("the default model is not installed")
    for messages in CONVERSATIONS:
        got = smol.apply_chat_template(messages)
        assert got == _reference(smol.chat_template, {
            "messages": messages, "add_generation_prompt": True, "bos_token": smol._token_text(smol.bos_id),
            "eos_token": smol._token_text(smol.eos_ids[0]), "tools": None, "documents": None})
    gemma = gemma3_path(assemble=False)
    if gemma is None:
        return
    tok = Tokenizer.from_gguf(gemma)
    if tok.chat_template is None:  # Gemma 3 270M is a base model: still no template, and still no chat
        assert tok.chat_unavailable is not None and "no chat template" in tok.chat_unavailable
    else:
        assert tok.chat_prompt("hi") == _reference(tok.chat_template, {
            "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
            "bos_token": tok._token_text(tok.bos_id), "eos_token": tok._token_text(tok.eos_ids[0]),
            "tools": None, "documents": None})
