"""How far a sequence's logits move when other sequences decode beside it in llama.cpp, by cache layout:
`python -m benchmarks.pooled_noise`. The default model's GGUF; three random-token prompts of 8 tokens (as the
scheduling lab draws them); sequence 0 decodes its own greedy continuation for 8 steps, alone and then with the two
others' rows in the same llama_batch, once in separate streams (kv_unified off, as generate_batch runs) and once in
one unified pool of cells (as the scheduling lab runs). Prints the largest |logit difference| from the sequence
alone at each step, and the CPU it ran on: llama.cpp's kernels differ by CPU class, and so does this.
tests/engine/test_runtime.py's POOLED_BATCH_NOISE is the allowance this measures.
"""

from __future__ import annotations

import numpy as np

from benchmarks.llamacpp import cpu_flags
from benchmarks.why import machine
from engine.backends.llamacpp import LlamaCppSession
from engine.events import TokenSampled
from engine.formats.locate import default_model_path
from engine.protocol import Capture, SamplingParams
from engine.runtime import Row
from engine.runtime.llamacpp import LlamaCppRuntime

STEPS = 8


def main() -> None:
    s = LlamaCppSession(default_model_path(), n_ctx=512)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(100, s.cfg.vocab_size, size=8).tolist() for _ in range(3)]
    alone = [e for e in s.generate(prompts[0], SamplingParams.greedy_params(), STEPS, ignore_eos=True,
                                   capture=Capture(logits=True)) if isinstance(e, TokenSampled)]
    print(f"{machine()}; CPU flags: {cpu_flags()}; {s.info.file_type}")
    for pooled in (False, True):
        rt = LlamaCppRuntime(s, n_seq=3, capacity=64, pooled=pooled)
        outs = rt.forward([Row(i, p) for i, p in enumerate(prompts)])
        diffs = []
        for e in alone:
            diffs.append(float(np.abs(outs[0].float().numpy() - e.logits).max()))
            others = [int(o.argmax()) for o in outs[1:]]
            outs = rt.forward([Row(0, [e.token_id]), Row(1, [others[0]]), Row(2, [others[1]])])
        rt.close()
        top = max(float(e.logits.max()) for e in alone)
        print(f"{'unified pool' if pooled else 'separate streams':>16}: max |Δlogit| per step "
              f"{' '.join(f'{d:.3g}' for d in diffs)} (largest top logit {top:.1f})")
    s.close()


if __name__ == "__main__":
    main()
