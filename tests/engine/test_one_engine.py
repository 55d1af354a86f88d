"""One engine over a runtime (issue 46), read from the source: the engine asks what a session, runtime or backend can
do (`session.can`, engine.backend.require, a runtime's methods), never what kind of thing it is; one ModelInfo
constructor; the seam's point names stated once.

The checks read engine/'s syntax trees, so each names the file and line of what it finds; each check is also run on
a snippet that must be caught, so a check that can no longer fail fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# the classes whose kind the engine must not ask about (sessions, runtimes, backends, a loaded model)
KINDS = {"Session", "LlamaCppSession", "Backend", "LocalBackend", "LlamaCppBackend", "ServerBackend", "Runtime",
         "TorchRuntime", "ContiguousRuntime", "LlamaCppRuntime", "LoadedModel", "Transformer"}
# names such objects go by, and attributes only one kind has
HOLDERS = {"session", "s", "backend", "rt", "runtime", "model", "lm", "owner", "self.backend", "self.session"}
TELLING = {"lm", "llama", "tap", "exit_logits", "session", "local"}


def _name(node: ast.AST) -> str:
    return ast.unparse(node)


def kind_checks(source: str, filename: str = "<snippet>") -> list[str]:
    """Each place in `source` that asks what kind a session, runtime or backend is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "isinstance" and len(args) == 2:
                classes = args[1].elts if isinstance(args[1], ast.Tuple) else [args[1]]
                hit = [_name(c) for c in classes if _name(c).split(".")[-1] in KINDS]
                if hit:
                    found.append(f"{where}: isinstance(…, {', '.join(hit)})")
            if node.func.id in ("hasattr", "getattr") and len(args) >= 2:
                attr = args[1].value if isinstance(args[1], ast.Constant) else None
                if attr in TELLING or (_name(args[0]) in HOLDERS and attr is not None):
                    found.append(f"{where}: {node.func.id}({_name(args[0])}, {attr!r})")
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            strings = {c.value for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant)}
            if any(_name(p).endswith("__name__") for p in parts) and strings & KINDS:
                found.append(f"{where}: {_name(node)}")
            names = {_name(p) for p in parts}
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and len(names & {
                    "self.backend", "self.local", "self.remote", "self.served_backend"}) == 2:
                found.append(f"{where}: {_name(node)}")
    return found


@pytest.mark.parametrize("snippet", [
    "isinstance(session, Session)", "isinstance(s, (int, LlamaCppSession))", "hasattr(session, 'llama')",
    "getattr(s, 'lm', None)", "type(session).__name__ == 'LlamaCppSession'", "cls.__name__ == 'TorchRuntime'",
    "self.backend is not self.local", "hasattr(runtime_class(s), 'exit_logits')",
])
def test_the_kind_check_catches(snippet):
    assert kind_checks(snippet), snippet


def test_nothing_in_the_engine_asks_what_kind_of_thing_it_holds():
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        found += kind_checks(path.read_text(encoding="utf-8"), str(path.relative_to(ENGINE.parent)))
    assert not found, "the engine asks what a thing is, not what it can do:\n" + "\n".join(found)


def test_one_modelinfo_constructor():
    """ModelInfo is made in engine/costs/info.py alone (the config, the file's facts, the runtime's storage)."""
    makers = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _name(node.func).split(".")[-1] == "ModelInfo":
                makers.append(f"{path.relative_to(ENGINE.parent)}:{node.lineno}")
    assert makers and all(m.startswith("engine/costs/info.py:") for m in makers), makers


def test_point_names_round_trip():
    """The seam's names (engine.model.seam) parse to the points they print as, and resid_pre.L+1 is resid_post.L."""
    from engine.model.seam import Point

    points = [Point.resid(0), Point.resid(3), Point.z(2), Point.z(2, 1), Point.attn(1), Point.mlp(0)]
    assert [str(p) for p in points] == ["resid_pre.0", "resid_post.2", "attn.z.2", "attn.z.2.1", "attn_out.1",
                                        "mlp_out.0"]
    assert [Point.parse(str(p)) for p in points] == points
    assert Point.parse("resid_pre.3") == Point.parse("resid_post.2") == Point.resid(3)
    for bad in ("resid.1", "attn.z", "mlp_out.x", "logits.0", ""):
        with pytest.raises(ValueError, match="unknown point"):
            Point.parse(bad)


# The engine's floors, bottom first: a folder (or top-level module) imports only from its own floor or below. Imports
# made for type annotations alone (under TYPE_CHECKING) are not counted.
FLOORS = [
    ("events", "protocol", "backend", "text", "cliargs"),  # the vocabulary: data, commands, argument types
    ("formats",),  # files on disk: GGUF headers, where models and caches live, control vectors
    ("tokenizer",),
    ("model",),  # the transformer, its kernels, the seam's points and torch hooks, thread counts
    ("costs",),  # formulas over the model's shapes, this machine's hardware
    ("loaders",),
    ("runtime",),  # one model with a KV cache of several sequences, one step
    ("run",),  # the engine: tokenize, generate, fork, sample, the torch session
    ("labs",),
    ("backends",),  # llama.cpp's session, the local backend, choosing one
    ("remote",),  # servers
    ("why",),  # experiments on a session, through the seam
    ("cli", "session_file"),  # the labs' commands; a saved session (any event of any source)
    ("server", "__main__", "__init__"),  # the engine process; the command line
]


def layer_violations(sources: dict[str, str]) -> list[str]:
    """Each import in `sources` (module name -> source) of a module on a floor above the importer's."""
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}

    def folder(module: str) -> str:
        return module.split(".")[1] if "." in module else "__init__"

    found = []
    for module, source in sources.items():
        tree = ast.parse(source)
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and _name(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine"):
                targets = [f"engine.{a.name}" for a in node.names] if node.module == "engine" else [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("engine.")]
            else:
                continue
            for target in targets:
                a, b = folder(module), folder(target)
                assert a in floor and b in floor, f"{module} or {target} is on no floor: add it to FLOORS"
                if floor[b] > floor[a]:
                    found.append(f"{module}:{node.lineno} imports {target} (floor {floor[b]} over {floor[a]})")
    return found


def test_the_layer_check_catches_an_import_from_above():
    assert layer_violations({"engine.model.x": "from engine.run.session import Session"})
    assert layer_violations({"engine.run.x": "def f():\n    import engine.why.patch"})
    assert not layer_violations({"engine.why.x": "from engine.run.session import Session"})
    assert not layer_violations({"engine.model.x": "if TYPE_CHECKING:\n    from engine.run.session import Engine"})


def test_no_engine_folder_imports_one_above_it():
    sources = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text(encoding="utf-8")
    found = layer_violations(sources)
    assert not found, "an engine folder imports one above it:\n" + "\n".join(found)
