"""Registers the why-experiments' subcommands (`heads`, `ablate`, `patch`, `attribute`, `compare`,
`dla`, `atp`, `steer`, `gallery`) on the engine's CLI.

Each module owns its parser and its command; importing one must not import torch (the CLI's start-up stays fast).
"""

from __future__ import annotations

import argparse
import importlib

MODULES: tuple[str, ...] = (  # engine.why.<name>, each with add_subcommand(sub)
    "ablate", "atp", "attribute", "compare", "dla", "gallery", "heads", "patch", "steer",
)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for name in MODULES:
        importlib.import_module(f"engine.why.{name}").add_subcommand(sub)
