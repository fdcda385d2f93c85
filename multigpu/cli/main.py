"""Entry point of the ``multigpu`` command."""

from __future__ import annotations

import argparse
import sys

from multigpu.cli import bench as bench_cmd
from multigpu.cli import calibrate as calibrate_cmd
from multigpu.cli import devices as devices_cmd
from multigpu.cli import run as run_cmd

_COMMANDS = {"run": run_cmd, "devices": devices_cmd, "bench": bench_cmd, "calibrate": calibrate_cmd}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit code 2 with the usage, as argparse does
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from multigpu import __version__

    parser = _Parser(prog="multigpu", description="Data-parallel Keras training across devices.")
    parser.add_argument("--version", action="version", version=f"multigpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"multigpu {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
