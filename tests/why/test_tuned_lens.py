"""The tuned lens (issue 47): identity maps are the logit lens exactly; maps are applied as x + A x + b before
transformers' own final norm and lm_head; the KL to the output against a float64 sum; saved and loaded without
pickle, damaged files refused in one sentence; fitting refused where there are no gradients; and, fitted on the default
model, below the logit lens on held-out text at every layer but the last, on the torch runtime and on llama.cpp's
residuals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.events import LensCaptured
from engine.model.seam import Point
from engine.run.lens import TunedLens, kl_bits_of_logits, lens_event, lens_logits, tuned_for
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from engine.why import tuned_lens as tl
from tests.requires import import_required

IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66]


def _stream(session: Session, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual rows (L + 1, d) at the last position of `ids` and the model's logits there, through the seam."""
    L = session.cfg.n_layers
    logits, rec = session.run_points([ids], record=[Point.resid(i) for i in range(L + 1)])
    return torch.stack([rec[Point.resid(i)][0, -1] for i in range(L + 1)]), logits[0]


def _random_lens(L: int, d: int, seed: int = 1) -> TunedLens:
    g = np.random.default_rng(seed)
    return TunedLens((0.05 * g.standard_normal((L, d, d))).astype(np.float32),
                     (0.1 * g.standard_normal((L, d))).astype(np.float32))


def test_identity_maps_are_the_logit_lens_exactly(tiny_lm):
    s = Session(tiny_lm)
    stream, logits = _stream(s, IDS)
    ident = TunedLens.identity(s.cfg.n_layers, s.cfg.d_model)
    assert torch.equal(lens_logits(tiny_lm.model, stream, logits, ident), lens_logits(tiny_lm.model, stream, logits))


def test_maps_before_transformers_own_norm_and_head(tiny_dir, tiny_lm):
    """transformers' model of the same checkpoint: its hidden states, by hand through x + A x + b in float64, then
    its own final norm and lm_head, equal the engine's tuned lens; identity maps equal its plain readout."""
    transformers = import_required("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir.hf_dir), dtype=torch.float32).eval()
    s = Session(tiny_lm)
    L, d = s.cfg.n_layers, s.cfg.d_model
    stream, logits = _stream(s, IDS)
    with torch.no_grad():
        out = hf(torch.tensor([IDS]), output_hidden_states=True)
        # hidden_states[ℓ], ℓ < L: the residual after ℓ layers (the last entry is already through the final norm)
        hs = torch.stack([h[0, -1] for h in out.hidden_states[:L]]).double()  # (L, d)
        np.testing.assert_allclose(stream[:L].numpy(), hs.numpy(), atol=1e-5, rtol=1e-5)
        for tuned in (TunedLens.identity(L, d), _random_lens(L, d)):
            a, b = torch.from_numpy(tuned.weight).double(), torch.from_numpy(tuned.bias).double()
            moved = torch.stack([hs[i] + a[i] @ hs[i] + b[i] for i in range(L)])  # x + A x + b, A out × in
            ref = hf.lm_head(hf.model.norm(moved.float()))  # (L, V)
            got = lens_logits(tiny_lm.model, stream, logits, tuned)
            np.testing.assert_allclose(got[:L].numpy(), ref.numpy(), atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(got[L:].numpy(), lens_logits(tiny_lm.model, stream, logits)[L:].numpy())


def test_kl_against_a_float64_sum():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[2, 17] = -math.inf  # a token the row rules out
    logits[4] = logits[-1]  # a row equal to the output: KL 0
    p = torch.softmax(logits, -1)
    got = kl_bits_of_logits(logits, p).numpy()
    lo = torch.log_softmax(logits.double(), -1)
    q = lo[-1].exp()
    want = [(q * (lo[-1] - lo[r])).sum().item() / math.log(2) for r in range(6)]
    assert math.isinf(want[2]) and math.isinf(got[2])
    keep = [0, 1, 3, 4, 5]
    np.testing.assert_allclose(got[keep], np.array(want)[keep], atol=2e-5, rtol=1e-5)
    assert got[4] == pytest.approx(0.0, abs=1e-6) and got[-1] == pytest.approx(0.0, abs=1e-6)


def test_event_carries_kl_and_the_tuned_rows_while_in_use(tiny_lm):
    s = Session(tiny_lm)
    stream, logits = _stream(s, IDS)
    head = s.runtime(1).lens_head()
    plain = lens_event(head, s.tokenizer, 0, len(IDS) - 1, stream, logits, 5, token=7)
    assert plain.tuned is None and plain.kl_bits.shape == (s.cfg.n_layers + 2,)
    lo = torch.log_softmax(lens_logits(head, stream, logits).double(), -1)
    want = (lo[-1].exp() * (lo[-1] - lo)).sum(-1) / math.log(2)
    np.testing.assert_allclose(plain.kl_bits, want.numpy(), atol=2e-5)
    tuned = _random_lens(s.cfg.n_layers, s.cfg.d_model)
    tl.use(s, tuned)
    try:
        assert tuned_for(head) is tuned
        ev = lens_event(head, s.tokenizer, 0, len(IDS) - 1, stream, logits, 5, token=7)
        lo_t = torch.log_softmax(lens_logits(head, stream, logits, tuned).double(), -1)
        np.testing.assert_allclose(ev.tuned.probs, lo_t.exp().topk(5, -1).values.numpy(), atol=1e-6)
        np.testing.assert_allclose(ev.tuned.token_probs, lo_t[:, 7].exp().numpy(), atol=1e-6)
        assert ev.tuned.kl_bits[-1] == pytest.approx(0.0, abs=1e-6) and ev.tuned.tuned is None
        np.testing.assert_array_equal(ev.probs, plain.probs)  # the logit lens's rows as they were
        # a generation's own lens (the runtime's head) carries it too
        evs = [e for e in s.generate(IDS, SamplingParams.greedy_params(), 2, Capture(lens_top=3), ignore_eos=True)
               if isinstance(e, LensCaptured)]
        assert len(evs) == 2 and all(e.tuned is not None and e.tuned.ids.shape == e.ids.shape for e in evs)
    finally:
        tl.use(s, None)
    assert tuned_for(head) is None


def test_saved_and_loaded_without_pickle(tmp_path):
    tuned = TunedLens(_random_lens(3, 8).weight, _random_lens(3, 8).bias, {"corpus": "x", "seconds": "1.0"})
    p = tl.save(tuned, tmp_path / "lens.safetensors")
    head = p.read_bytes()[:8]
    assert int.from_bytes(head, "little") < 4096 and p.read_bytes()[8:9] == b"{"  # safetensors: a JSON header
    back = tl.load(p, 3, 8)
    np.testing.assert_array_equal(back.weight, tuned.weight)
    np.testing.assert_array_equal(back.bias, tuned.bias)
    assert back.facts == tuned.facts
    with pytest.raises(ValueError, match="this model has 4 layers of width 8"):
        tl.load(p, 4, 8)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"0" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        tl.load(tmp_path / "junk.safetensors", 3, 8)
    (tmp_path / "big.safetensors").write_bytes(b"\x00" * (3 << 20))
    with pytest.raises(ValueError, match="more than a tuned lens"):
        tl.load(tmp_path / "big.safetensors", 3, 8)
    with pytest.raises(ValueError, match="cannot read the tuned lens"):
        tl.load(tmp_path / "none.safetensors", 3, 8)
    bad = TunedLens(np.full((3, 8, 8), np.nan, np.float32), tuned.bias)
    with pytest.raises(ValueError, match="not finite"):
        tl.load(tl.save(bad, tmp_path / "nan.safetensors"), 3, 8)


def test_corpus_file_errors_in_one_sentence(tmp_path, tiny_lm):
    s = Session(tiny_lm)
    with pytest.raises(ValueError, match="cannot read the corpus"):
        tl.corpus_text(str(tmp_path / "missing.txt"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(ValueError, match="not UTF-8"):
        tl.corpus_text(str(tmp_path / "bin.txt"))
    (tmp_path / "short.txt").write_text("a few words only")
    with pytest.raises(ValueError, match="needs"):
        tl.make_corpus(s, str(tmp_path / "short.txt"), 256, 256)


def _llama(path):
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    return LlamaCppSession(path, threads=1)


def test_fitting_needs_gradients(tiny_dir):
    from engine.backend import Unsupported

    with pytest.raises(Unsupported, match="fitting a tuned lens needs gradients.*llama.cpp runtime"):
        tl.fit(_llama(tiny_dir.gguf), steps=1)


def test_fit_on_the_tiny_model_lowers_held_out_kl_and_is_bounded(tiny_lm):
    """A fit's stages on the tiny model, with a fake clock: the time bound stops the KL steps, Cancel stops the fit."""
    s = Session(tiny_lm)
    ticks = iter(range(10_000))
    tuned = tl.fit(s, tokens=512, held_out=256, steps=50, seconds=3.0, clock=lambda: float(next(ticks)))
    facts = tl.summary(tuned)
    assert int(facts["kl_steps"]) < 50  # the clock ran out first
    logit, fitted = facts["held_out_logit_kl_bits"], facts["held_out_tuned_kl_bits"]
    assert len(logit) == len(fitted) == s.cfg.n_layers + 1
    assert all(t < g for t, g in zip(fitted[:-1], logit[:-1], strict=True)), (logit, fitted)
    from engine.why import Cancelled

    with pytest.raises(Cancelled):
        tl.fit(s, tokens=512, held_out=256, steps=5, should_stop=lambda: True)
    with pytest.raises(ValueError, match="GiB of residuals; this model takes at most"):
        tl.fit(s, tokens=10**9)
    with pytest.raises(ValueError, match="0 to 10,000 KL steps"):
        tl.fit(s, steps=-1)


@pytest.mark.slow
def test_fitted_on_the_default_model_beats_the_logit_lens_on_held_out_text(real_lm):
    """Fitted on Python's help text (2,048 tokens, a few KL steps), judged on held-out text of the same corpus (128
    positions; 32 through llama.cpp): every layer but the last is closer to the output through the tuned lens, on
    torch and through llama.cpp's residuals."""
    from tests.requires import default_model

    s = Session(real_lm)
    tuned = tl.fit(s, tokens=2048, held_out=512, steps=6, judged=128)
    facts = tl.summary(tuned)
    logit, fitted = facts["held_out_logit_kl_bits"], facts["held_out_tuned_kl_bits"]
    L = s.cfg.n_layers
    assert all(t < g for t, g in zip(fitted[:L], logit[:L], strict=True)), (logit, fitted)
    assert logit[L] == pytest.approx(0.0, abs=1e-3) and fitted[L] == pytest.approx(0.0, abs=1e-3)
    # the same maps read llama.cpp's residual rows of the same file
    llama = _llama(default_model())
    data = tl.make_corpus(llama, None, 2048, 512)
    rows = tl.residual_rows(llama, data.held[:1])[:, :32]
    logit_l, tuned_l = tl.held_out_kl(llama, rows, tuned)
    assert all(t < g for t, g in zip(tuned_l[:L], logit_l[:L], strict=True)), (logit_l, tuned_l)


def test_the_engine_process_fits_uses_and_drops_it(tiny_dir, tmp_path, monkeypatch):
    """TuneLens through the engine process (as the app drives it): "use" before a fit says none is saved; a fit
    reports progress, is saved and in use (the next generation's lens carries the tuned rows and KL); "off" drops
    it; "use" finds the saved one again; Cancel ends a fit with nothing saved over."""
    from engine import protocol as P
    from engine.protocol import Capture as Cap
    from engine.protocol import GenerateRequest
    from tests.engine.test_server import Client

    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))  # no lens another test saved
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
        assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
        c.send(P.TuneLens(1, "use"))
        none = c.until(lambda m: isinstance(m, P.LensTuned))[-1]
        assert not none.in_use and "no tuned lens is saved" in none.error

        c.send(P.TuneLens(2, "fit", tokens=512, steps=2))
        seen = c.until(lambda m: isinstance(m, P.LensTuned))
        fitted = seen[-1]
        assert fitted.in_use and not fitted.error, fitted
        assert any(isinstance(m, P.Progress) and m.job == "tuned_lens" for m in seen)
        L = tiny_dir.cfg["n_layers"]
        assert len(fitted.summary["held_out_tuned_kl_bits"]) == L + 1 and fitted.summary["kl_steps"] == "2"

        def lens_of_a_generation():
            req = GenerateRequest("the cat sat", chat=False, max_new_tokens=1, params=SamplingParams.greedy_params(),
                                  capture=Cap(lens_top=3), ignore_eos=True)
            c.send(P.Generate(req))
            msgs = c.until(lambda m: type(m).__name__ == "Finished")
            return [m for m in msgs if isinstance(m, LensCaptured)][0]

        ev = lens_of_a_generation()
        assert ev.tuned is not None and ev.tuned.kl_bits.shape == (L + 2,) and ev.kl_bits.shape == (L + 2,)
        c.send(P.TuneLens(3, "off"))
        assert not c.until(lambda m: isinstance(m, P.LensTuned))[-1].in_use
        assert lens_of_a_generation().tuned is None
        c.send(P.TuneLens(4, "use"))
        again = c.until(lambda m: isinstance(m, P.LensTuned))[-1]
        assert again.in_use and again.summary == fitted.summary
        c.send(P.TuneLens(5, "fit", tokens=512, steps=10_000))
        c.send(P.Cancel())
        assert c.until(lambda m: isinstance(m, P.LensTuned))[-1].cancelled
    finally:
        c.send(P.Quit())
        c.thread.join(10)


def test_a_session_file_keeps_both_lenses(tiny_lm, tmp_path):
    """A step's LensCaptured with its KL and its tuned rows is saved in a session file and read back as it was."""
    from engine.session_file import SavedSession, load_session, save_session

    s = Session(tiny_lm)
    stream, logits = _stream(s, IDS)
    head = s.runtime(1).lens_head()
    tl.use(s, _random_lens(s.cfg.n_layers, s.cfg.d_model))
    try:
        ev = lens_event(head, s.tokenizer, 0, len(IDS) - 1, stream, logits, 5, token=7)
    finally:
        tl.use(s, None)
    save_session(tmp_path / "run.ilab", SavedSession(events=[ev]))
    (back,) = load_session(tmp_path / "run.ilab", with_tokenizer=False).events
    for a, b in ((ev, back), (ev.tuned, back.tuned)):
        for name in ("ids", "probs", "entropy_bits", "token_probs", "kl_bits"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.pieces == b.pieces
    assert back.tuned.tuned is None


def test_llama_cpp_generations_read_through_the_same_maps(tiny_dir, tiny_lm):
    """A tuned lens in use on a llama.cpp session: its generation's lens carries the tuned rows, which equal the
    torch engine's through the same maps within llama.cpp's float16 K/V rounding."""
    llama = _llama(tiny_dir.gguf)
    torch_s = Session(tiny_lm)
    tuned = _random_lens(torch_s.cfg.n_layers, torch_s.cfg.d_model)
    capture = Capture(lens_top=4)
    got = {}
    for name, s in (("llama", llama), ("torch", torch_s)):
        tl.use(s, tuned)
        try:
            got[name] = [e for e in s.generate(IDS, SamplingParams.greedy_params(), 2, capture, ignore_eos=True)
                         if isinstance(e, LensCaptured)]
        finally:
            tl.use(s, None)
    assert len(got["llama"]) == len(got["torch"]) == 2
    for a, b in zip(got["llama"], got["torch"], strict=True):
        assert a.tuned is not None and b.tuned is not None
        np.testing.assert_allclose(a.tuned.token_probs, b.tuned.token_probs, atol=2e-2)
        np.testing.assert_allclose(a.tuned.kl_bits, b.tuned.kl_bits, atol=5e-2)
        assert not np.allclose(a.tuned.kl_bits[:-2], a.kl_bits[:-2], atol=1e-3)  # the maps moved the rows


def test_the_lens_command_fits_once_then_loads(capsys, tiny_dir, tmp_path, monkeypatch):
    """`engine lens --tuned`: the first run fits and saves (progress on stderr), a later one loads the saved maps, on
    llama.cpp too; the JSON's rows carry both lenses; llama.cpp with none saved refuses in one line."""
    import json

    from tests.why.conftest import run_cli

    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))
    base = ("lens", "--model", str(tiny_dir.gguf), "--prompt", "the cat sat", "--greedy", "--threads", "1")
    code, out, err = run_cli(capsys, *base, "--backend", "llama.cpp", "--tuned")
    assert code == 1 and "fitting a tuned lens needs gradients" in err and len(err.strip().splitlines()) == 2
    code, out, err = run_cli(capsys, *base, "--tuned", "--fit-tokens", "512", "--fit-steps", "1", "--json")
    assert code == 0, err
    assert "fitting a tuned lens" in err and "saved to" in err
    d = json.loads(out)
    L = tiny_dir.cfg["n_layers"]
    assert len(d["layers"]) == L + 2 and all("tuned" in r and "kl_bits" in r["tuned"] for r in d["layers"])
    assert d["tuned_lens"]["kl_steps"] == "1" and len(d["tuned_lens"]["held_out_tuned_kl_bits"]) == L + 1
    code, out2, err2 = run_cli(capsys, *base, "--backend", "llama.cpp", "--tuned", "--json")
    assert code == 0 and "fitting" not in err2, err2
    assert json.loads(out2)["tuned_lens"] == d["tuned_lens"]
    code, text, _ = run_cli(capsys, *base, "--tuned")
    assert code == 0 and "KL tuned" in text and "the tuned lens's top tokens" in text
