"""The instruction sets a llama.cpp build was compiled for, against the ones this machine's OS has enabled.

llama.cpp reports its compiled-in CPU features in `llama_print_system_info()` ("AVX2 = 1 | AMX_INT8 = 1 | …"). A
build that uses an instruction the running machine does not allow dies of SIGILL inside a product, taking the
process with it — no exception to catch. Two ways that happens: a library built elsewhere (or natively on a newer
CPU), and ggml's AMX kernel, which runs tile instructions on OpenMP worker threads that never asked the kernel for
tile-data permission (llama.cpp pull request #26954) and so dies even on a CPU that has AMX; a native build
(`-march=native`, llama.cpp's default) compiles that kernel on such a CPU (issue #28328 is the wider class: a build
that picks an instruction set the OS or hypervisor has not enabled). Checking the string before the first product
turns either into one sentence. `cmake_args` gives the options that build a library
passing this check on the machine that builds it (packaging/llama_cmake_args.py prints them for the Makefile).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

# llama.cpp's feature names → the /proc/cpuinfo flags the feature needs (all of them)
FEATURE_FLAGS: dict[str, tuple[str, ...]] = {
    "SSE3": ("pni",),
    "SSSE3": ("ssse3",),
    "AVX": ("avx",),
    "AVX_VNNI": ("avx_vnni",),
    "AVX2": ("avx2",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "BMI2": ("bmi2",),
    "AVX512": ("avx512f",),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_INT8": ("amx_int8",),
}
# Crash on worker threads whatever the CPU has (the module's docstring).
NEVER = ("AMX_INT8",)


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first `flags` line (or of the text given); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def compiled_features(system_info: str) -> frozenset[str]:
    """The CPU features a llama.cpp system-info string says are on ("NAME = 1")."""
    return frozenset(m.group(1) for m in re.finditer(r"\b([A-Z][A-Z0-9_]*) = 1\b", system_info))


def unsafe_features(system_info: str, flags: frozenset[str]) -> list[str]:
    """Features the build uses that would crash here: AMX always; any other x86 one whose flag this CPU lacks.

    Without any cpuinfo flags (not Linux, not x86) nothing can be judged and nothing is reported.
    """
    used = compiled_features(system_info)
    bad = [f for f in NEVER if f in used]
    if flags:
        bad += [f for f, needs in FEATURE_FLAGS.items()
                if f in used and f not in bad and not all(n in flags for n in needs)]
    return bad


def refusal(system_info: str, flags: frozenset[str]) -> str | None:
    """One sentence for a build that would crash here, or None when it is safe."""
    bad = unsafe_features(system_info, flags)
    if not bad:
        return None
    why = ("its AMX kernel crashes on llama.cpp's worker threads (llama.cpp pull request #26954)" if bad == ["AMX_INT8"]
           else "this CPU does not allow them")
    return (f"this llama.cpp build uses {', '.join(bad)}, and {why}: rebuild it for this machine with "
            f"CMAKE_ARGS=\"{' '.join(cmake_args(flags))}\" pip install --force-reinstall --no-cache-dir "
            f"--no-binary llama-cpp-python llama-cpp-python==0.3.36 (make test does)")


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


def cmake_args(flags: frozenset[str] | None, machine: str | None = None) -> list[str]:
    """`-D` options for llama.cpp's CMake: no native tuning on x86, each instruction set named, AMX off.

    Off x86 (or with no flags to read) the native build stays: the AMX fault is x86-only.
    """
    if (machine or platform.machine()) not in ("x86_64", "AMD64", "i686") or not flags:
        return []
    args = ["-DGGML_NATIVE=OFF"]
    for option, needs in X86_OPTIONS.items():
        args.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
    args += [f"-D{option}=OFF" for option in ALWAYS_OFF]
    return args
