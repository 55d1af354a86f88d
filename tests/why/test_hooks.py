"""engine.model.seam held to a forward pass written by hand (tests/why/conftest.py) on the tiny random Llama model,
and to Hugging Face transformers' Gemma 3 for the post-norm sites."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from engine.model.kv_cache import KVCache
from engine.model.seam import Edit, Point, edited
from tests.why.conftest import engine_logits

IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41]
OTHER = [9, 31, 8, 120, 66, 13, 290, 17, 240]  # a "corrupted" prompt of the same length
TOL = dict(atol=2e-4, rtol=2e-4)  # float32 engine against the float64 reference


def _hooks_left(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_zeroing_a_head_equals_the_forward_by_hand(tiny_dir, tiny_lm, by_hand):
    model, w = tiny_lm.model, tiny_dir.hf_weights

    def zero_head(site, layer, v):
        if site == "z" and layer == 1:
            v = v.clone()
            v[:, 2] = 0
        return v

    ref = by_hand(w, IDS, zero_head).float()
    clean = by_hand(w, IDS).float()
    assert (ref - clean).abs().max() > 1e-2  # the head matters, so the comparison can fail
    with edited(model, [Edit(Point.z(1, 2))]):
        got = engine_logits(model, IDS)
    assert_close(got, ref, **TOL)
    assert_close(engine_logits(model, IDS), clean, **TOL)  # and nothing is left behind


def test_zeroing_heads_at_chosen_positions(tiny_dir, tiny_lm, by_hand):
    model, w = tiny_lm.model, tiny_dir.hf_weights
    positions = (2, 5)

    def zero(site, layer, v):
        v = v.clone()
        if site == "z" and layer == 0:
            v[list(positions), 1] = 0
            v[list(positions), 3] = 0
        return v

    with edited(model, [Edit(Point.z(0, 1), positions=positions), Edit(Point.z(0, 3), positions=positions)]):
        got = engine_logits(model, IDS)
    assert_close(got, by_hand(w, IDS, zero).float(), **TOL)


@pytest.mark.parametrize("site", ["attn", "mlp"])
def test_zeroing_a_layers_attention_or_mlp_output(tiny_dir, tiny_lm, by_hand, site):
    model, w = tiny_lm.model, tiny_dir.hf_weights
    ref = by_hand(w, IDS, lambda s, layer, v: torch.zeros_like(v) if (s, layer) == (site, 0) else v).float()
    point = Point.attn(0) if site == "attn" else Point.mlp(0)
    with edited(model, [Edit(point)]):
        assert_close(engine_logits(model, IDS), ref, **TOL)


def test_recorded_points_equal_the_forward_by_hand(tiny_dir, tiny_lm, by_hand):
    model, w = tiny_lm.model, tiny_dir.hf_weights
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(site, layer, v):
        seen[site, layer] = v.clone()
        return v

    by_hand(w, IDS, keep)
    points = [Point.z(1, 3), Point.z(0), Point.attn(1), Point.mlp(0), Point.resid(0), Point.resid(1), Point.resid(2)]
    with edited(model, record=points) as rec:
        engine_logits(model, IDS)
    T = len(IDS)
    assert_close(rec[Point.z(1, 3)][0].double(), seen["z", 1][:, 3], **TOL)
    assert_close(rec[Point.z(0)][0].double(), seen["z", 0].reshape(T, -1), **TOL)
    assert_close(rec[Point.attn(1)][0].double(), seen["attn", 1], **TOL)
    assert_close(rec[Point.mlp(0)][0].double(), seen["mlp", 0], **TOL)
    for layer in range(3):
        assert_close(rec[Point.resid(layer)][0].double(), seen["resid", layer], **TOL)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_setting_the_residual_to_the_clean_run_reproduces_the_clean_logits(tiny_lm, layer):
    model = tiny_lm.model
    with edited(model, record=[Point.resid(layer)]) as rec:
        clean = engine_logits(model, IDS)
    corrupt = engine_logits(model, OTHER)
    assert (clean - corrupt).abs().max() > 1e-1
    with edited(model, [Edit(Point.resid(layer), rec[Point.resid(layer)][0])]):
        patched = engine_logits(model, OTHER)
    assert_close(patched, clean, atol=1e-5, rtol=1e-5)  # what follows layer L reads only the clean stream


def test_a_different_residual_edit_in_each_row(tiny_dir, tiny_lm, by_hand):
    """Patching's batch: row b sets the residual after layer 1 at position b to the clean run's value there."""
    model, w = tiny_lm.model, tiny_dir.hf_weights
    with edited(model, record=[Point.resid(1)]) as rec:
        engine_logits(model, IDS)
    clean_resid = rec[Point.resid(1)][0]  # (T, d)
    rows = 4
    edits = [Edit(Point.resid(1), clean_resid[b], positions=(b,), rows=(b,)) for b in range(rows)]
    with edited(model, edits):
        got = engine_logits(model, [OTHER] * rows)  # (B, T, V)
    for b in range(rows):
        def patch(site, layer, v, b=b):
            if (site, layer) == ("resid", 1):
                v = v.clone()
                v[b] = clean_resid[b].double()
            return v

        assert_close(got[b], by_hand(w, OTHER, patch).float(), **TOL)


def test_an_edit_holds_across_kv_cached_decode_steps(tiny_dir, tiny_lm, by_hand):
    """Positions are absolute: a prefill then decode steps edit the same positions as one full pass."""
    model, w = tiny_lm.model, tiny_dir.hf_weights

    def zero(site, layer, v):
        v = v.clone()
        if site == "z" and layer == 1:
            v[:, 0] = 0  # head 0 at every position
        if site == "mlp" and layer == 0:
            v[[1, 7]] = 0  # the MLP at positions 1 and 7 only (7 is run by a decode step)
        return v

    ref = by_hand(w, IDS, zero).float()
    cache = KVCache(model.cfg, 1, len(IDS), torch.float32)
    with edited(model, [Edit(Point.z(1, 0)), Edit(Point.mlp(0), positions=(1, 7))]), torch.inference_mode():
        rows = [model(torch.tensor([IDS[:6]]), cache, all_logits=True)[0]]
        for t in range(6, len(IDS)):
            rows.append(model(torch.tensor([[IDS[t]]]), cache, all_logits=True)[0])
    assert_close(torch.cat(rows), ref, **TOL)


def test_setting_a_head_to_a_value(tiny_dir, tiny_lm, by_hand):
    model, w = tiny_lm.model, tiny_dir.hf_weights
    value = torch.linspace(-1, 1, tiny_lm.cfg.head_dim)

    def put(site, layer, v):
        if (site, layer) == ("z", 0):
            v = v.clone()
            v[3, 2] = value.double()
        return v

    with edited(model, [Edit(Point.z(0, 2), value, positions=(3,))]):
        assert_close(engine_logits(model, IDS), by_hand(w, IDS, put).float(), **TOL)


def test_hooks_are_removed_after_the_block_even_on_an_exception(tiny_lm):
    model = tiny_lm.model
    before = _hooks_left(model)
    clean = engine_logits(model, IDS)
    with pytest.raises(RuntimeError, match="inside"):
        with edited(model, [Edit(Point.z(0, 0)), Edit(Point.resid(2))], record=[Point.mlp(1)]):
            assert _hooks_left(model) > before
            raise RuntimeError("inside")
    assert _hooks_left(model) == before
    assert torch.equal(engine_logits(model, IDS), clean)


@pytest.mark.parametrize(("point", "message"), [
    (Point.z(2, 0), "layers 0 to 1"), (Point.z(0, 4), "heads 0 to 3"), (Point.resid(3), "to 2"),
    (Point.mlp(-1), "layers 0 to 1"), (Point("attn", 0, 1), "no head"),
])
def test_points_outside_the_model_are_refused_before_any_hook(tiny_lm, point, message):
    before = _hooks_left(tiny_lm.model)
    with pytest.raises(ValueError, match=message):
        with edited(tiny_lm.model, [Edit(point)]):
            pass
    assert _hooks_left(tiny_lm.model) == before


def test_a_value_of_the_wrong_shape_is_refused(tiny_lm):
    with edited(tiny_lm.model, [Edit(Point.resid(1), torch.zeros(5, 7))]):
        with pytest.raises(ValueError, match="does not broadcast"):
            engine_logits(tiny_lm.model, IDS)


def test_gemma3_attn_and_mlp_sites_are_after_the_post_norms(tmp_path):
    """What Gemma 3 adds to the residual is the post-norm's output: setting it equals transformers' model with a hook
    setting post_attention_layernorm's (or post_feedforward_layernorm's) output. A value, not zero, since a norm
    of zero is zero: set before the norm, the residual would receive norm(value) instead."""
    from tests.requires import import_required

    import_required("transformers")
    from engine.loaders import load
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path, "gemma3")
    lm = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    ids = IDS[:7]
    value = torch.linspace(-2, 3, lm.cfg.d_model)
    for point, name in [(Point.attn(5), "post_attention_layernorm"), (Point.mlp(2), "post_feedforward_layernorm")]:
        module = getattr(ck.model.model.layers[point.layer], name)
        handle = module.register_forward_hook(lambda _m, _a, out: value.expand_as(out).clone())
        try:
            with torch.no_grad():
                ref = ck.model(torch.tensor([ids]), use_cache=False).logits[0].float()
        finally:
            handle.remove()
        with edited(lm.model, [Edit(point, value)]):
            got = engine_logits(lm.model, ids)
        assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert (got - engine_logits(lm.model, ids)).abs().max() > 1e-3  # the edit changed something
    with torch.no_grad():  # the residual stream at 0 is the embeddings × √d as the first block receives them
        hidden = ck.model(torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
    with edited(lm.model, record=[Point.resid(0), Point.resid(3)]) as rec:
        engine_logits(lm.model, ids)
    assert_close(rec[Point.resid(0)][0], hidden[0][0], atol=1e-4, rtol=1e-4)
    assert_close(rec[Point.resid(3)][0], hidden[3][0], atol=1e-4, rtol=1e-4)


def test_a_ragged_batch_edits_each_row_at_its_own_positions():
    """Rows of a continuous batch start at their own positions: absolute position 4 is row 0's index 4 and row 1's
    index 1 when row 1 starts at 3 (written out here by hand)."""
    from engine.model.seam import _apply

    x = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    want = x.clone()
    want[0, 4], want[1, 1] = -1, -1
    got = x.clone()
    _apply(got, Edit(Point.resid(0), torch.full((3,), -1.0), positions=(4,)), slice(None), [0, 3])
    assert torch.equal(got, want)
