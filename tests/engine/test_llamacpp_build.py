"""llama.cpp is built so it cannot die of an illegal instruction on the machine that runs it — checked on any machine.

On an Intel Xeon with AMX a native build crashed the suite (SIGILL in ggml's AMX kernel, llama.cpp pull request
#26954). A developer without such a CPU still catches a regression here: the build options are derived for each
machine class this project has met (from the flags Linux lists there), the Makefile's recipe is held to use them, and
the library that is installed, in the app's environment and in the server's, is read back (its system-info string)
against this machine's flags.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends import isa
from tests.requires import import_required, missing

ROOT = Path(__file__).resolve().parents[2]

_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
         "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni "
         "pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand "
         "hypervisor lahf_lm abm 3dnowprefetch fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap clflushopt "
         "sha_ni xsaveopt xsavec xgetbv1 arat")
# The three classes: AMD EPYC with AVX2 only (this project's machines' first class, Zen 1), AMD EPYC with AVX-512 and
# avx512_bf16 (Zen 4), Intel Xeon with AVX-512 and AMX (Sapphire Rapids), each as a KVM guest lists its flags.
CLASSES = {
    "epyc-avx2": _BASE + " cmp_legacy sse4a misalignsse osvw topoext clzero xsaveerptr virt_ssbd",
    "epyc-avx512-bf16": _BASE + " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
                                "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq",
    "xeon-amx": _BASE + " avx512f avx512dq avx512ifma clwb avx512cd avx512bw avx512vl xsaves avx_vnni avx512_bf16 "
                        "avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
                        "avx512_bitalg avx512_vpopcntdq serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8",
}


def _options(flags: frozenset[str]) -> dict[str, str]:
    return dict(a.removeprefix("-D").split("=") for a in isa.cmake_args(flags, "x86_64"))


@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_build_names_each_instruction_set_and_never_amx(cls: str) -> None:
    flags = isa.cpu_flags(f"processor\t: 0\nflags\t\t: {CLASSES[cls]}\n")
    opts = _options(flags)
    assert opts["GGML_NATIVE"] == "OFF"  # -march=native would compile the AMX kernel on the Xeon
    assert all(opts[o] == "OFF" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert opts["GGML_AVX2"] == opts["GGML_FMA"] == opts["GGML_F16C"] == "ON"  # every class: no speed thrown away
    assert opts["GGML_AVX512"] == ("OFF" if cls == "epyc-avx2" else "ON")
    assert opts["GGML_AVX512_BF16"] == ("OFF" if cls == "epyc-avx2" else "ON")
    assert opts["GGML_AVX_VNNI"] == ("ON" if cls == "xeon-amx" else "OFF")


def test_no_flags_keeps_the_native_build() -> None:
    """Off x86 (or without /proc/cpuinfo) there is nothing to name, and the AMX fault cannot happen."""
    assert isa.cmake_args(frozenset(), "x86_64") == []
    assert isa.cmake_args(isa.cpu_flags(f"flags : {CLASSES['xeon-amx']}"), "aarch64") == []


def test_the_makefiles_script_prints_the_engines_options(tmp_path: Path) -> None:
    """packaging/llama_cmake_args.py runs on the bare interpreter (before any venv) and says what the engine says."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {CLASSES['xeon-amx']}\n")
    out = subprocess.run(["python3", "-I", "packaging/llama_cmake_args.py", "--cpuinfo", str(cpuinfo)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    if platform.machine() == "x86_64":
        assert out == isa.cmake_args(isa.cpu_flags(cpuinfo.read_text())) and "-DGGML_AMX_INT8=OFF" in out


def test_makefile_builds_llama_cpp_with_these_options_and_no_cached_wheel() -> None:
    out = subprocess.run(["make", "-n", "-B", ".venv-servers/wheels/.built"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    build = out[out.index("CMAKE_ARGS="):]
    assert build.startswith('CMAKE_ARGS="$(python3 packaging/llama_cmake_args.py)"') and "pip wheel" in build
    assert "--no-cache-dir" in build and "--no-binary llama-cpp-python" in build


@pytest.mark.parametrize(("info", "cls", "bad"), [
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |", "xeon-amx", ["AMX_INT8"]),
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 |", "epyc-avx2", ["AVX512", "AVX512_BF16"]),
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |", "xeon-amx", []),
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 0 |", "epyc-avx512-bf16", []),
])
def test_a_build_that_would_crash_is_named(info: str, cls: str, bad: list[str]) -> None:
    flags = isa.cpu_flags(f"flags : {CLASSES[cls]}")
    assert isa.unsafe_features(info, flags) == bad
    why = isa.refusal(info, flags)
    assert (why is None) == (not bad)
    if bad:
        assert all(f in why for f in bad) and "\n" not in why


def test_the_backend_refuses_an_amx_build_before_running_it(monkeypatch: pytest.MonkeyPatch) -> None:
    llama_cpp = import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends import llamacpp
    from engine.formats.locate import ModelLoadError

    monkeypatch.delattr(llama_cpp, "_lab_ggml", raising=False)
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1 |")
    with pytest.raises(ModelLoadError, match="AMX_INT8"):
        llamacpp._llama()


def _system_info(python: str) -> str:
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.parametrize("where", ["app", "server"])
def test_the_installed_library_runs_only_what_this_machine_allows(where: str) -> None:
    if where == "app":
        import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
        python = sys.executable
    else:
        python = str(ROOT / ".venv-servers/llamacpp/bin/python")
        if not Path(python).exists():
            missing("servers", f"{python} does not exist")
    info = _system_info(python)
    flags = isa.cpu_flags()
    assert isa.refusal(info, flags) is None, info
    # and it is not a build without SIMD: what the machine has, the library uses
    used = isa.compiled_features(info)
    assert {f for f in ("AVX", "AVX2", "FMA", "F16C") if all(n in flags for n in isa.FEATURE_FLAGS[f])} <= used, info
