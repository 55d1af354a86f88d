"""Benchmarks, outside the shipped packages: `python -m benchmarks COMMAND` with bench, kernel-modes, bench-load,
bench-gemv, bench-profile or bench-sampling (the GUI ones run as `python -m benchmarks.gui` and
`python -m benchmarks.startup`). Each prints ratios in one run."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.cliargs import CliError, Parser


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks import bench, gemv, kernel_modes, load, profile, sampling, steer_llamacpp

    p = Parser(prog="python -m benchmarks", description="Inference Lab's benchmarks (ratios in one run).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    bench.add_subcommands(sub)
    kernel_modes.add_subcommand(sub)
    load.add_subcommand(sub)
    gemv.add_subcommand(sub)
    profile.add_subcommand(sub)
    sampling.add_subcommand(sub)
    steer_llamacpp.add_subcommand(sub)
    args = p.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
