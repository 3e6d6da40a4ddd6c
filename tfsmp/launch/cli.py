"""The `tfsmp` command: run, doctor, install-horovod, plan, schedule, export, timeline."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# Each module defines `register(subparsers)`, which adds one sub-command whose parser sets
# `func(args) -> int`. Modules import TensorFlow/MPI only inside `func`, so `tfsmp --help` is fast.
COMMANDS = [
    "tfsmp.launch.cmd_run",
    "tfsmp.launch.cmd_doctor",
    "tfsmp.launch.cmd_horovod",
    "tfsmp.launch.cmd_plan",
    "tfsmp.launch.cmd_schedule",
    "tfsmp.launch.cmd_export",
    "tfsmp.launch.cmd_timeline",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfsmp", description="Pipeline model parallelism for TensorFlow/Keras (SMP-compatible).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
