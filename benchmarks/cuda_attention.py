"""cuDNN's attention on a GPU, left in and left out, each in a fresh process: `python -m benchmarks.cuda_attention
--shapes DIR [--rounds 2]` (DIR as benchmarks.cuda_decode's: a model's config and tokenizer files).

Why: cuDNN builds an execution graph for each new attention shape and caches it, and a decode step attends over one
more key than the step before. The engine leaves cuDNN out when it loads on a GPU
(engine.model.transformer.leave_out_cudnn_attention); "cudnn" puts it back after the load, as torch's default has it.
Each process prints one line: three 128-token greedy generations on one session (each a little longer prompt, so
the first meets new shapes and the later ones some known), then the median decode step of the labs' paged runtime at
batch 1 and 16.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(path: Path, cudnn: bool) -> None:
    import torch

    from benchmarks.cuda_decode import PROMPT
    from engine.events import Finished
    from engine.loaders import load
    from engine.protocol import SamplingParams
    from engine.run.session import Session
    from engine.runtime.base import Row
    from engine.runtime.torch import TorchRuntime

    lm = load(path, device="cuda", dtype="bfloat16")
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    s = Session(lm)
    tpot = []
    for r in range(3):
        for ev in s.generate(PROMPT + " x" * r, SamplingParams.greedy_params(), 128, chat=True, ignore_eos=True):
            if isinstance(ev, Finished):
                tpot.append(round(ev.tpot_s * 1e3, 2))

    def paged_step(B: int, n: int = 24) -> float:
        rt = TorchRuntime(lm, B, 160)
        logits = rt.forward([Row(i, list(range(100, 228))) for i in range(B)])
        nxt = [int(x.argmax()) for x in logits]
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = rt.forward([Row(i, [nxt[i]]) for i in range(B)])
            nxt = [int(x.argmax()) for x in logits]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return round(sorted(times)[n // 2] * 1e3, 2)

    paged = {B: paged_step(B) for B in (1, 16)}
    print(f"cudnn_sdp={torch.backends.cuda.cudnn_sdp_enabled()} session runs tpot_ms={tpot} "
          f"paged median ms={paged}", flush=True)


def main(argv: list[str]) -> int:
    if "--child" in argv:
        child(Path(argv[argv.index("--child") + 1]), "--cudnn" in argv)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("torch sees no CUDA GPU: this benchmark runs on a machine with one", file=sys.stderr)
        return 1
    shapes = Path(argv[argv.index("--shapes") + 1])
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    from benchmarks.cuda_decode import write_random_weights

    with tempfile.TemporaryDirectory(prefix="ilab-cuda-") as tmp:
        path = write_random_weights(shapes, Path(tmp) / "model")
        for _ in range(rounds):
            for cudnn in (["--cudnn"], []):
                subprocess.run([sys.executable, "-m", "benchmarks.cuda_attention", "--child", str(path), *cudnn],
                               check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
