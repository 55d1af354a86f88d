"""The CMake options that build llama.cpp for the instruction sets this machine's OS has enabled — and never AMX.

A native build (`-march=native`, llama.cpp's default) on an Intel Xeon with AMX compiles ggml's AMX kernel, whose
`tilezero` runs on OpenMP worker threads that never asked the kernel for tile-data permission (XFD): SIGILL on any
prompt longer than a few tokens (llama.cpp pull request #26954; issue #28328 for builds that pick an instruction set
the OS or hypervisor has not enabled). So the build names each instruction set itself, from the flags the kernel
reports in /proc/cpuinfo (the kernel clears a flag whose state it does not save), and leaves the three AMX options
off. The speed cost on each machine class is in BENCHMARKS.md ("llama.cpp build").

    python packaging/llama_cmake_args.py              # the options for this machine, one line (CMAKE_ARGS)
    python packaging/llama_cmake_args.py --cpuinfo F  # for another machine's /proc/cpuinfo

Standard library only: the Makefile runs it before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
from pathlib import Path

# The engine's reading of /proc/cpuinfo, loaded by path: the engine package's imports need the virtual environment,
# which does not exist yet when the Makefile runs this.
_ISA = Path(__file__).resolve().parent.parent / "engine/backends/isa.py"
_spec = importlib.util.spec_from_file_location("_isa", _ISA)
_isa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_isa)
cpu_flags = _isa.cpu_flags

# ggml's x86 options, each with the /proc/cpuinfo flags every one of its compiler switches needs
# (ggml-cpu/CMakeLists.txt: GGML_AVX512 adds -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw).
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
# Never on, whatever the CPU says (see the module's docstring).
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(flags: frozenset[str] | None, machine: str = "x86_64") -> list[str]:
    """`-D` options for llama.cpp's CMake: no native tuning on x86, each instruction set named, AMX off.

    Off x86 (or with no flags to read) the native build stays: the AMX fault is x86-only.
    """
    if machine not in ("x86_64", "AMD64", "i686") or not flags:
        return []
    args = ["-DGGML_NATIVE=OFF"]
    for option, needs in X86_OPTIONS.items():
        args.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
    args += [f"-D{option}=OFF" for option in ALWAYS_OFF]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpuinfo", default="/proc/cpuinfo", help="a /proc/cpuinfo to read (default: this machine's)")
    args = parser.parse_args(argv)
    try:
        text = Path(args.cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    print(" ".join(cmake_args(cpu_flags(text), platform.machine())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
