"""Fixtures shared by the remote-backend tests: the default model exported as a Hugging Face directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def exported_hf(tmp_path_factory):
    """The default GGUF exported with `export-hf` (what the vLLM fixture serves), written once per session."""
    from engine.export_hf import export

    return export(None, tmp_path_factory.mktemp("export") / "smollm2-hf")
