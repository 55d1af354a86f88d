"""Print the CMake options that build llama.cpp for the instruction sets this machine's OS has enabled, never AMX.

The options and why are the engine's (engine/backends/isa.py, `cmake_args`), so an installed app can name them
too; the speed cost on each machine class is in BENCHMARKS.md ("Every CPU class").

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

# The engine's module, loaded by path: the engine package's imports need the virtual environment,
# which does not exist yet when the Makefile runs this.
_ISA = Path(__file__).resolve().parent.parent / "engine/backends/isa.py"
_spec = importlib.util.spec_from_file_location("_isa", _ISA)
_isa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_isa)
cpu_flags, cmake_args = _isa.cpu_flags, _isa.cmake_args


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
