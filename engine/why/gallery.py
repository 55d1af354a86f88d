"""The gallery: canned why-experiments, each one click on the loaded model, each with a short text saying what it
shows and what to look for.

    python -m engine gallery              # list them
    python -m engine gallery NAME [--json]

Each entry turns into one of the panel's experiments (engine.protocol's HeadsParams, PatchParams or DlaParams) made
for the loaded model: its prompts use only words that are one token in the model's vocabulary (a name pair, the
year digits), so that the same entry runs on SmolLM2, Gemma 3 or any other model, or says in one sentence why it
cannot. A run returns the entry's words, the params it chose and the experiment's own result (the dict its command
prints), which the app draws in that experiment's view and keeps in the session.

    induction       head roles on random tokens repeated once, then the top induction heads zero-ablated
    ioi             indirect object identification: patching one name pair, per position and per head
    greater-than    direct logit attribution of a later year's digits over an earlier one's
    factual-recall  patching "The Eiffel Tower is in the city of" into "The Colosseum is in the city of"
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from engine.protocol import DlaParams, HeadsParams, PatchParams
from engine.why import Cancelled, Progress, ShouldStop, Unsupported, check_stop


@dataclass(frozen=True)
class Entry:
    name: str
    title: str
    kind: str  # the experiment it runs: "heads", "patch" or "dla"
    shows: str  # what it shows, in a few sentences
    look_for: str  # what to look for in the result


INDUCTION = Entry(
    "induction", "Induction heads on repeated random tokens", "heads",
    "A run of random tokens, then the same run again. Nothing in the text predicts the first copy; the second copy "
    "is predictable only by looking back: find the earlier copy of the current token and read what came after it. "
    "Heads that do this are induction heads, and they usually work together with previous-token heads in an earlier "
    "layer. The most induction-like heads are then switched off (their output set to zero) and the second copy's "
    "loss is measured again, beside switching off as many other heads.",
    "In the induction map a few bright cells, in the middle or later layers, and bright cells for previous-token "
    "heads in the layers before them. The summary's loss: switching off the top induction heads should raise the "
    "second copy's loss far more than switching off the control heads.")
IOI = Entry(
    "ioi", "Indirect object: who gets the drink?", "patch",
    "\"When A and B went to the store, B gave a drink to\" asks for A, the name that did not repeat. The corrupted "
    "prompt repeats the other name, so the answer flips. Patching copies the clean run's activations into the "
    "corrupted run one cell at a time and measures how much of the clean answer's margin (A over B) comes back; "
    "the per-head grid does the same for each head's output at every position.",
    "In the residual grid, the restoring cells move from the repeated name's position in the early layers to the "
    "last position in the later ones: the layers where that move happens are where the model carries the name "
    "across. In the per-head grid, the few heads with large values are the ones that copy the name (click one to "
    "see its attention: it should look at the answer's name from the last position).")
GREATER_THAN = Entry(
    "greater-than", "Greater-than: a later year", "dla",
    "\"The war lasted from the year 1752 to the year 17\" is followed by a later year. Direct logit attribution "
    "splits the final residual stream into what each head, each MLP and the embeddings wrote into it, and reads "
    "each part's share of the logit difference between the likeliest digits above and below the start year's.",
    "Most of the margin should come from a few MLPs in the later layers (they compare numbers) and from a handful "
    "of heads that attend to the start year. Red cells push the later year up, blue ones push it down; the "
    "summary's frozen-norm error says how well the parts add up to the model's own logit difference.")
FACTUAL_RECALL = Entry(
    "factual-recall", "Factual recall: the Eiffel Tower", "patch",
    "\"The Eiffel Tower is in the city of\" against \"The Colosseum is in the city of\": both prompts have the same "
    "length in tokens and ask for a city. Patching the clean residual stream into the corrupted run, one layer and "
    "one position at a time, finds where the fact about the subject is looked up and how it travels to the last "
    "position.",
    "Two bright regions: at the subject's tokens in the early and middle layers (the model recalls the fact there, "
    "much of it in MLPs; the token that tells the two landmarks apart carries most of it), then at the last "
    "position from the middle layers on (attention has moved it there). Cells at the shared words restore nothing: "
    "both runs are the same there.")
GALLERY: tuple[Entry, ...] = (INDUCTION, IOI, GREATER_THAN, FACTUAL_RECALL)
NAMES = tuple(e.name for e in GALLERY)

INDUCTION_REPEAT = 24
NAME_PAIRS = (("Mary", "John"), ("Anna", "David"), ("Sarah", "James"), ("Alice", "Bob"), ("Emma", "Tom"),
              ("Lisa", "Mark"), ("Kate", "Paul"))
IOI_TEMPLATE = "When {a} and {b} went to the store, {s} gave a drink to"
YEAR_PREFIX = "The war lasted from the year 17{yy} to the year 17"
START_YEAR = 52  # two digits after the century: the answer's digits are compared with these
CLEAN, CORRUPT, ANSWER, WRONG = ("The Eiffel Tower is in the city of", "The Colosseum is in the city of", " Paris",
                                 " Rome")


def entry(name: str) -> Entry:
    """The gallery's entry of that name; ValueError naming the others otherwise."""
    for e in GALLERY:
        if e.name == name:
            return e
    raise ValueError(f"the gallery has no experiment {name!r}: choose one of {', '.join(NAMES)}")


def _one_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special=False).ids
    return int(ids[0]) if len(ids) == 1 else None


def ioi_params(session) -> PatchParams:
    """The first name pair of NAME_PAIRS whose names are each one token (with the leading space) and whose clean and
    corrupted prompts have equal token lengths."""
    tried = []
    for a, b in NAME_PAIRS:
        clean = IOI_TEMPLATE.format(a=a, b=b, s=b)
        corrupt = IOI_TEMPLATE.format(a=a, b=b, s=a)
        tried.append(f"{a}/{b}")
        if _one_token(session.tokenizer, " " + a) is None or _one_token(session.tokenizer, " " + b) is None:
            continue
        if len(session.tokenize(clean).ids) == len(session.tokenize(corrupt).ids):
            return PatchParams(clean, corrupt, " " + a, " " + b, heads=True)
    raise ValueError(f"none of the name pairs ({', '.join(tried)}) is one token per name in this model's "
                     "vocabulary, so the indirect-object experiment cannot be set up on it")


def year_candidates(session, prompt_ids: list[int], prefix: str) -> tuple[int, dict[int, int]]:
    """How the model's vocabulary continues `prefix` (which ends with the century "17"): as single digits or as
    two-digit tokens (the width that most of 00…99 or 0…9 is one token right after the prompt's own tokens), and
    value → token id for each continuation that is one token there."""
    for width in (2, 1):
        found = {}
        for n in range(10 ** width):
            text = str(n).zfill(width)
            ids = session.tokenize(prefix + text).ids
            if len(ids) == len(prompt_ids) + 1 and list(ids[:-1]) == list(prompt_ids):
                found[n] = int(ids[-1])
        if len(found) >= 10 ** width // 2:
            return width, found
    raise ValueError("this model's vocabulary writes neither single digits nor two-digit numbers as one token "
                     "after the century, so the greater-than experiment cannot be set up on it")


def greater_than_params(session) -> DlaParams:
    """The likeliest next token above the start year against the likeliest below it, at the prompt's last position:
    the digit pairs 53…99 against 00…51 where the vocabulary has two-digit tokens, else the tens digits 6…9 against
    0…4 (5, the start's own, could go either way)."""
    import torch

    prompt = YEAR_PREFIX.format(yy=START_YEAR)
    ids = list(session.tokenize(prompt).ids)
    width, found = year_candidates(session, ids, prompt)
    start = START_YEAR if width == 2 else START_YEAR // 10
    with torch.inference_mode():
        logits, _ = session.run_points([ids])
    row = logits[0].float().cpu()
    above = {n: i for n, i in found.items() if n > start}
    below = {n: i for n, i in found.items() if n < start}
    if not above or not below:
        raise ValueError("this model's vocabulary lacks the year digits on one side of the start year")
    best_above = max(above.values(), key=lambda i: float(row[i]))
    best_below = max(below.values(), key=lambda i: float(row[i]))
    tok = session.tokenizer
    return DlaParams(prompt, tok.piece(best_above), tok.piece(best_below))


def induction_ablation_k(n_layers: int, n_heads: int) -> int:
    """How many top induction heads are switched off: five, or a quarter of a small model's heads."""
    return max(1, min(5, n_layers * n_heads // 4))


def run(session, name: str, progress: Progress | None = None, should_stop: ShouldStop | None = None) -> dict:
    """Set up the entry `name` for the loaded model and run it: {"name", "title", "kind", "shows", "look_for",
    "params" (the experiment's params as plain data), "result" (that experiment's result)}. ValueError in one
    sentence where the entry cannot be set up on this model; Unsupported where the runtime cannot run it;
    Cancelled when `should_stop` says so."""
    e = entry(name)
    check_stop(should_stop)
    params: HeadsParams | PatchParams | DlaParams
    if e is INDUCTION:
        from engine.why.heads import confirm_induction, head_roles

        params = HeadsParams(repeat=INDUCTION_REPEAT, seed=0)
        part = _part(progress, 0.0, 0.5)
        result = head_roles(session, repeat=params.repeat, seed=params.seed, progress=part, should_stop=should_stop)
        k = induction_ablation_k(session.cfg.n_layers, session.cfg.n_heads)
        result["ablation"] = confirm_induction(session, result, k, progress=_part(progress, 0.5, 1.0),
                                               should_stop=should_stop)
    elif e is GREATER_THAN:
        from engine.why.dla import dla

        params = greater_than_params(session)
        check_stop(should_stop)
        if progress is not None:
            progress(0.0, "one forward pass, every head's output")
        result = dla(session, params.prompt, params.answer, params.wrong, step=params.step, chat=params.chat)
    else:
        from engine.why.patch import patch

        params = ioi_params(session) if e is IOI else PatchParams(CLEAN, CORRUPT, ANSWER, WRONG)
        result = patch(session, params.clean, params.corrupt, params.answer, params.wrong, heads=params.heads,
                       progress=progress, should_stop=should_stop)
    if progress is not None:
        progress(1.0, "done")
    return {"name": e.name, "title": e.title, "kind": e.kind, "shows": e.shows, "look_for": e.look_for,
            "params": asdict(params), "result": result}


def _part(progress: Progress | None, lo: float, hi: float) -> Progress | None:
    """`progress` for one part of a run: its fractions mapped into [lo, hi]."""
    if progress is None:
        return None
    return lambda f, message: progress(lo + (hi - lo) * f, message)


# ---- the command line --------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `gallery` to the engine's CLI."""
    from engine.cliargs import add_model_args, add_threads_arg

    q = sub.add_parser("gallery", help="canned why-experiments (induction, an indirect-object name pair, "
                                       "greater-than, factual recall): list them, or run one on the model")
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("name", nargs="?", choices=NAMES, help="the experiment to run (none: list them)")
    q.set_defaults(func=_cmd, local_only="reads and writes inside the forward pass, which a server does not let us do")


def _cmd(a: argparse.Namespace) -> int:
    from engine.cliargs import EXACT_PRODUCTS, one_line, stamped

    if a.name is None:
        if a.json:
            print(json.dumps([asdict(e) for e in GALLERY], ensure_ascii=False))
            return 0
        for e in GALLERY:
            print(f"{e.name:<15} {e.title} ({e.kind})")
        return 0
    from engine.backends import session_from_args

    s = session_from_args(a)
    with one_line(ValueError, Unsupported, Cancelled, RuntimeError):
        out = run(s, a.name)
    if a.json:
        # patching and DLA force the float products; head roles run the model's own kernels
        kernels = EXACT_PRODUCTS if out["kind"] in ("patch", "dla") else None
        print(json.dumps(stamped(out, s.info, kernels), ensure_ascii=False))
        return 0
    print(f"{out['title']}\n\n{out['shows']}\n\nWhat to look for: {out['look_for']}\n")
    print(summary(out))
    return 0


def summary(out: dict) -> str:
    """A few lines on a gallery run's result (what the CLI prints after the entry's words)."""
    r, p = out["result"], out["params"]
    if out["kind"] == "heads":
        from engine.why.heads import top_heads

        best = ", ".join(f"{layer}:{head} {v:.2f}" for layer, head, v in top_heads(r["scores"]["induction"], 5))
        lines = [f"strongest induction heads (layer:head score): {best}"]
        ab = r.get("ablation")
        if ab is not None:
            lines.append(f"second copy's loss {ab['loss']:.3f} nats; top {len(ab['heads'])} induction heads off "
                         f"{ab['loss_ablated']:.3f}; as many other heads off {ab['loss_control']:.3f}")
        return "\n".join(lines)
    if out["kind"] == "dla":
        top = ", ".join(f"{c['component']} {c['contribution']:+.2f}" for c in r["top"][:6])
        return (f"{p['prompt']!r}: logit difference {r['answer']['token']!r} − {r['wrong']['token']!r} "
                f"{r['logit_diff']:.3f} (sum of the parts {r['sum']:.3f}); largest parts: {top}")
    grid = r["restored"]
    layer, pos = max(((i, j) for i in range(len(grid)) for j in range(len(grid[0]))), key=lambda c: grid[c[0]][c[1]])
    return (f"clean {p['clean']!r} against corrupted {p['corrupt']!r}, {p['answer']!r} over {p['wrong']!r}: logit "
            f"difference {r['clean_logit_diff']:.3f} clean, {r['corrupt_logit_diff']:.3f} corrupted; the largest "
            f"restore {grid[layer][pos]:+.2f} is the stream after {layer} layers at position {pos} "
            f"({r['tokens']['clean'][pos]!r})")
