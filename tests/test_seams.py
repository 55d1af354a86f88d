"""The house's seams hold: no import circles, no switches on which kind of backend runs, no bridge attributes used
as channels between panels, and the benchmarks stay out of the shipped packages."""

import ast
import sys
from pathlib import Path

import numpy as np

from engine import protocol as P
from engine.backend import Backend
from engine.events import Failed, PromptTokenized, RunSource, RunStarted
from engine.protocol import GenerateRequest, PreviewResult

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("engine", "app") for p in (ROOT / d).rglob("*.py")]


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (at any depth: a lazy import inside a function still ties two modules);
    `from package import module` ties to the module, not to the package's __init__."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else ".".join(mod.split(".")[:-node.level] + [node.module])
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            out |= subs if len(subs) == len(node.names) else subs | {base}
    return {m for m in out if m.split(".")[0] in ("engine", "app")}


def test_no_import_circles():
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in SOURCES}
    graph = {m: {i for i in _imports(p, set(modules)) if i in modules and i != m} for m, p in modules.items()}
    # an import of a package runs its __init__, which is the package module itself: edges go to real modules only
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " → ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    sys.setrecursionlimit(10_000)
    for m in sorted(graph):
        if m not in state:
            visit(m)


class _ThirdRun:
    """A generation of _ThirdBackend: its events are whatever the backend says."""

    def __init__(self, req, source) -> None:
        self.params, self.capture = req.params, req.capture
        self._events = [RunStarted(source=source), ("third backend ran", req.text)]

    def __iter__(self):
        return iter(self._events)

    def stop(self) -> None:
        pass


class _ThirdBackend(Backend):
    """A backend of neither kind the app ships (not engine.backends.local's, not engine.remote.served's): the Backend
    interface and nothing more, with the kind its RunSource states for the record."""

    def __init__(self, kind: str) -> None:
        self._source = RunSource(kind=kind, name="third")

    @property
    def source(self) -> RunSource:
        return self._source

    def generate(self, req):
        if not req.text:
            raise ValueError("the third backend wants a prompt")
        return _ThirdRun(req, self._source)

    def preview(self, request_id, text, chat, top, params):
        return PreviewResult(request_id, text, n_tokens=len(text), n_reused=0, n_computed=len(text), seconds=0.0,
                             funnel=("third funnel", top))

    def tokenize(self, text, chat=False):
        text = f"third chat: {text}" if chat else text
        n = len(text)
        return PromptTokenized(text=text, ids=np.arange(n), pieces=tuple(text), offsets=np.zeros((n, 2), np.int64),
                               byte_offsets=np.zeros((n, 2), np.int64), special=np.zeros(n, bool))

    def run_lab(self, request, send, should_stop):
        if isinstance(request, P.BatchBench):
            send(("third batch row", request.batches))
            return
        super().run_lab(request, send, should_stop)  # the base class's one sentence for a lab it cannot run


def _transcript(backend: Backend) -> list[tuple]:
    """What the engine process answers a fixed series of commands with while `backend` runs generations, as
    (message type, what it says) pairs, a run's source by its name."""
    import multiprocessing
    import threading

    from engine.server import EngineServer

    cmd_recv, commands = multiprocessing.Pipe(duplex=False)
    events, events_send = multiprocessing.Pipe(duplex=False)
    server = EngineServer(cmd_recv, events_send)
    server.remote = backend  # what Connect leaves it with; the engine holds no model of its own here
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    for cmd in (
        P.Tokenize(1, "hi", chat=True),
        P.Preview(2, "hi", False, 3),
        P.Generate(GenerateRequest("hi", chat=False)),
        P.Generate(GenerateRequest("", chat=False)),
        P.Generate(GenerateRequest("hi", chat=False, ablation=P.Ablated(mlp_layers=(0,)))),
        P.BatchBench((1, 2), 4, 2),
        P.Speculate("hi"),
        P.Experiment(3, P.HeadsParams()),
        P.Ping(7),
    ):
        commands.send(cmd)
    out: list[tuple] = []
    while ("Stopped", ()) not in out:
        assert events.poll(60), f"the engine process stopped answering; so far: {out}"
        got = events.recv()
        for m in got if isinstance(got, list) else [got]:
            if isinstance(m, P.Tokenized):
                out.append(("Tokenized", (m.request_id, m.prompt.text, m.chat_prompt.text, m.error, m.chat_error)))
            elif isinstance(m, P.PreviewResult):
                out.append(("PreviewResult", (m.request_id, m.text, m.funnel)))
            elif isinstance(m, RunStarted):
                out.append(("RunStarted", (m.source.name,)))
            elif isinstance(m, P.LabDone):
                out.append(("LabDone", (m.job, m.outcome, m.message)))
            elif isinstance(m, P.ExperimentDone):
                out.append(("ExperimentDone", (m.request_id, m.unsupported, m.failure != "", m.result)))
            elif isinstance(m, P.State):
                out.append(("State", (m.state,)))
            elif isinstance(m, Failed):
                out.append(("Failed", (m.message.split(":")[0],)))  # its sentence, up to what it says to do
            elif isinstance(m, P.Progress):
                continue
            else:
                out.append((type(m).__name__, m if isinstance(m, tuple) else ()))
        if out[-1] == ("Pong", ()):
            commands.send(P.Quit())  # once the rest are answered: a Quit cancels the job in progress
    thread.join(10)
    assert not thread.is_alive()
    return out


def test_the_engine_process_asks_its_backend_never_its_kind():
    """The engine process (engine.server) holds one backend and never asks which kind it is: a third backend, of
    neither class the app ships, is served through the Backend interface alone (its tokenizer, its previews, its
    runs, its labs, its one-sentence refusals), and the same backend answers the same whichever kind its source
    states. A server that switched on the backend's class or kind, or reached past the interface (a local model's
    session, a server's client), would answer differently here, or fail."""
    expected = [
        ("Tokenized", (1, "hi", "third chat: hi", "", "")),
        ("PreviewResult", (2, "hi", ("third funnel", 3))),
        ("State", ("generating",)), ("RunStarted", ("third",)), ("tuple", ("third backend ran", "hi")),
        ("State", ("idle",)),
        ("Failed", ("the third backend wants a prompt",)), ("State", ("idle",)),
        ("Failed", ("generating from an ablated model edits the model's forward pass, which a server does not "
                    "expose",)),  # the backend had no why_session: engine.why.ablated's sentence
        ("State", ("idle",)),
        ("tuple", ("third batch row", (1, 2))), ("LabDone", ("batch", "done", "")),
        ("LabDone", ("spec", "unsupported", "the speculative-decoding lab does not run on third")),
        ("ExperimentDone", (3, True, True, None)),
        ("Pong", ()),
        ("Stopped", ()),
    ]
    for kind in ("local", "server"):
        assert _transcript(_ThirdBackend(kind)) == expected, kind


def test_panels_use_no_bridge_attribute_as_a_channel():
    """Request knobs go through bridge.options' methods; nothing outside the bridge writes a bridge attribute or
    reads one by name with getattr (signals excepted: panels connect to them by name)."""
    offenders = []
    for path in SOURCES:
        if path.name == "bridge.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and _is_bridge(el.value):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} writes bridge.{el.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and node.args and _is_bridge(node.args[0])):
                name = node.args[1]
                if not (isinstance(name, ast.Name) and name.id in ("signal", "name")):  # a signal by name
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads the bridge with getattr")
    assert not offenders, offenders


def _is_bridge(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "bridge") or (
        isinstance(node, ast.Attribute) and node.attr == "bridge")


def test_benchmarks_are_not_shipped():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(p.startswith("benchmarks") for p in include)
    assert not list((ROOT / "engine").rglob("bench*.py")) and not list((ROOT / "app").rglob("bench*.py"))


def test_the_readme_map_matches_the_tree():
    """Every engine folder and top-level engine module is on the README's map, and everything on it exists."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## How it is built"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    engine_lines, inside = [], False
    for line in block.splitlines():  # the indented lines under engine/
        inside = line.startswith("engine/") or (inside and line.startswith("  "))
        engine_lines += [line] if inside and line.startswith("  ") else []
    named = {w.rstrip("/") for line in engine_lines for w in line.split()[:1] if w.endswith(("/", ".py"))}
    engine = ROOT / "engine"
    actual = {p.name for p in engine.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    actual |= {p.name for p in engine.glob("*.py") if p.name != "__init__.py" and p.name != "cliargs.py"}
    missing = actual - named
    assert not missing, f"on disk but not on the README's map: {sorted(missing)}"
    for name in named:
        assert (engine / name).exists(), f"the README's map names engine/{name}, which does not exist"


def test_the_readme_lists_every_panel_by_its_title():
    from app.panels import PANEL_MODULES

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[:text.index("## Setting up")]
    for name in PANEL_MODULES:
        module = __import__(f"app.panels.{name}", fromlist=["PANEL"])
        panel = module.PANEL
        assert f"| {panel.title} ({panel.shortcut}) |" in table, f"README's panel table lacks {panel.title}"


def _kind_switches(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code asks a run's source (or an event) what kind it is instead of what it can report: `….kind` compared
    with "server" or "local", and isinstance(…, Remote…)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            kinds = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "kind"]
            words = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in ("server", "local")]
            if kinds and words:
                found.append((node.lineno, f".kind compared with {words[0]!r}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for c in classes:
                name = c.id if isinstance(c, ast.Name) else c.attr if isinstance(c, ast.Attribute) else ""
                if name.startswith("Remote"):
                    found.append((node.lineno, f"isinstance(…, {name})"))
    return found


def test_the_app_asks_a_run_source_what_it_can_report_never_its_kind():
    """RunSource says what a run can report (cannot, token_ids_are_local, measured_by_server): a panel or the bridge
    that switches on `kind == "server"` or on a server's event classes leans around the seam, and a third source
    (another runtime, a remote engine) would be drawn wrong."""
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line} {what}" for line, what in _kind_switches(ast.parse(path.read_text("utf-8")))]
    assert not offenders, offenders


def test_the_rule_finds_a_switch_on_kind():
    """The check above is not blind: it finds each form it forbids, and passes the questions it asks instead."""
    bad = ('if src.kind == "server": pass\nif "local" != run.source.kind: pass\n'
           'if isinstance(ev, RemoteTokenSampled): pass\nif isinstance(ev, (Finished, remote.RemoteGeneration)): pass')
    assert [line for line, _ in _kind_switches(ast.parse(bad))] == [1, 2, 3, 4]
    good = 'if src.measured_by_server: pass\nif not src.token_ids_are_local: pass\nif kind == "heads": pass'
    assert _kind_switches(ast.parse(good)) == []


def test_the_backend_takes_one_lab_request_not_a_method_per_lab():
    """Labs reach a backend through run_lab(request, send, should_stop) and end in one typed LabDone: no backend
    grows a method of its own per lab again."""
    lab_methods = {"batch_bench", "speculate", "schedule", "serve_bench"}
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id.endswith("Backend") for b in node.bases) or (
                    isinstance(node, ast.ClassDef) and node.name == "Backend"):
                offenders += [f"{path.relative_to(ROOT)}:{f.lineno} {node.name}.{f.name}" for f in node.body
                              if isinstance(f, ast.FunctionDef) and f.name in lab_methods]
    assert not offenders, offenders
