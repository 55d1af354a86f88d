"""The gallery's experiments (engine.why.gallery) on the command line and as the engine sets them up for a model: the
greater-than entry's two digits are the likeliest above and below the start year by Hugging Face transformers' own
logits of the same weights; an entry the vocabulary cannot express says so in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.why.gallery import GALLERY, NAMES, START_YEAR, YEAR_PREFIX, greater_than_params, run
from tests.requires import import_required
from tests.why.conftest import run_cli


def test_the_list_names_every_experiment(capsys):
    code, out, err = run_cli(capsys, "gallery")
    assert code == 0, err
    assert [line.split()[0] for line in out.strip().splitlines()] == list(NAMES)
    code, out, err = run_cli(capsys, "gallery", "--json")
    listed = json.loads(out)
    assert [e["name"] for e in listed] == list(NAMES) and all(e["shows"] and e["look_for"] for e in listed)
    assert {e.kind for e in GALLERY} == {"heads", "patch", "dla"}


def test_greater_than_reads_the_likeliest_digits_on_each_side_by_transformers(tiny_session, tiny_dir):
    """The tiny vocabulary writes single digits: the tens digit after "…to the year 17" is read, and the answer and
    the wrong token are the likeliest digit above and the likeliest below the start year's (5), by transformers."""
    transformers = import_required("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir.hf_dir), dtype=torch.float32).eval()
    params = greater_than_params(tiny_session)
    prompt = YEAR_PREFIX.format(yy=START_YEAR)
    assert params.prompt == prompt and params.step == 0
    tok = tiny_session.tokenizer
    ids = tiny_session.tokenize(prompt).ids
    with torch.no_grad():
        logits = hf(torch.tensor([list(ids)])).logits[0, -1].double().numpy()
    digit = {d: tok.encode(str(d), add_special=False).ids for d in range(10)}
    assert all(len(v) == 1 for v in digit.values())
    above = max(range(6, 10), key=lambda d: logits[digit[d][0]])
    below = max(range(0, 5), key=lambda d: logits[digit[d][0]])
    assert (params.answer, params.wrong) == (str(above), str(below))


def test_a_run_carries_its_words_params_and_the_experiments_result(tiny_session):
    from engine.why.dla import dla

    out = run(tiny_session, "greater-than")
    assert out["name"] == "greater-than" and out["kind"] == "dla" and out["shows"] and out["look_for"]
    p = out["params"]
    want = dla(tiny_session, p["prompt"], p["answer"], p["wrong"])
    np.testing.assert_allclose(out["result"]["heads"], want["heads"], atol=1e-9)
    assert abs(out["result"]["frozen_norm_error"]) < 1e-4
    with pytest.raises(ValueError, match="the gallery has no experiment 'nope'"):
        run(tiny_session, "nope")


@pytest.mark.parametrize("name, needle", [
    ("ioi", "none of the name pairs"),
    ("factual-recall", "patching needs prompts of equal token length"),
])
def test_an_entry_the_vocabulary_cannot_express_says_so_in_one_line(tiny_dir, capsys, name, needle):
    code, out, err = run_cli(capsys, "gallery", name, "--model", str(tiny_dir.gguf), "--backend", "torch",
                             "--threads", "1")
    assert code == 1 and needle in err and len(err.strip().splitlines()) == 1, err


def test_induction_on_the_command_line(tiny_dir, capsys):
    code, out, err = run_cli(capsys, "gallery", "induction", "--model", str(tiny_dir.gguf), "--backend", "torch",
                             "--threads", "1", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["kind"] == "heads" and d["params"] == {"repeat": 24, "seed": 0}
    ab = d["result"]["ablation"]
    assert len(ab["heads"]) == 2 and ab["loss"] > 0 and d["kernels"] == "exact"
    code, out, err = run_cli(capsys, "gallery", "induction", "--model", str(tiny_dir.gguf), "--backend", "torch",
                             "--threads", "1")
    assert code == 0 and "What to look for" in out and "strongest induction heads" in out, err
