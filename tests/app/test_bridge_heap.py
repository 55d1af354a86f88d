"""A loaded model's objects (its tokenizer's vocabulary above all) are left out of the collector's later walks: a
full collection walked them all while holding the GIL, and the GUI froze for it now and then during a run."""

from __future__ import annotations

import gc

from engine.protocol import Loaded


def test_a_loaded_models_objects_are_frozen_out_of_later_collections(bridge, tiny_lm):
    gc.unfreeze()
    try:
        tracked_before = len(gc.get_objects())
        bridge._loads_sent.clear()
        bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
        assert bridge.tokenizer is tiny_lm.tokenizer
        assert gc.get_freeze_count() >= tracked_before // 2  # what lived then now sits out of every collection
        assert len(gc.get_objects()) < tracked_before // 2
        assert not any(o is tiny_lm.tokenizer.__dict__ for o in gc.get_objects())
    finally:
        gc.unfreeze()
