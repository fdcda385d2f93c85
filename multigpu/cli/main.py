"""Entry point of the ``multigpu`` command.

Every command takes its devices the same way: ``--devices cpu:0,cpu:1`` or
``--devices cpu:0 cpu:1``.  Every misuse (a bad flag or value, a backend
that is not installed) exits with code 2 and one line saying what was
received and what is allowed.
"""

from __future__ import annotations

import argparse
import re
import sys

from multigpu.cli import bench as bench_cmd
from multigpu.cli import calibrate as calibrate_cmd
from multigpu.cli import devices as devices_cmd
from multigpu.cli import plan as plan_cmd
from multigpu.cli import run as run_cmd
from multigpu.devices import looks_like_devices
from multigpu.log import print_always

_COMMANDS = {"run": run_cmd, "devices": devices_cmd, "bench": bench_cmd, "calibrate": calibrate_cmd,
             "plan": plan_cmd}
_DEVICE_FLAGS = ("--devices", "--gpus")
# The extra of pyproject.toml (and the package in it) that brings a module multigpu may need but does not require.
_EXTRAS = {"jax": ("jax", "jax"), "jaxlib": ("jax", "jax"), "tensorflow": ("tensorflow", "tensorflow"),
           "matplotlib": ("plot", "matplotlib")}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit code 2 and one line
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from multigpu import __version__

    parser = _Parser(prog="multigpu", description="Data-parallel Keras training across devices.",
                     epilog="Run 'multigpu COMMAND --help' for a command's flags and examples.")
    parser.add_argument("--version", action="version", version=f"multigpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return parser


def join_device_lists(argv: list[str]) -> list[str]:
    """``--devices cpu:0 cpu:1`` (spaces) as ``--devices cpu:0,cpu:1`` (commas), up to ``run``'s script (whose
    own arguments are left as they are)."""
    out: list[str] = []
    i = 0
    is_run = bool(argv) and argv[0] == "run"
    while i < len(argv):
        token = argv[i]
        out.append(token)
        i += 1
        if token in _DEVICE_FLAGS:
            group = []
            while i < len(argv) and looks_like_devices(argv[i]):
                group.append(argv[i].strip(","))
                i += 1
            if group:
                out.append(",".join(group))
        elif is_run and len(out) > 1 and not token.startswith("-"):
            return out + argv[i:]  # the script: the rest is its own
        elif is_run and token in run_cmd.VALUE_FLAGS and i < len(argv):
            out.append(argv[i])
            i += 1
    return out


def _pinned(extra: str, package: str) -> str:
    """``package`` with the versions the extra ``extra`` of multigpu's pyproject.toml allows (``jax<0.11,>=0.5``),
    else its bare name (multigpu not installed as a distribution)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        lines = requires("keras-multigpu") or []
    except PackageNotFoundError:
        return package
    for line in lines:
        requirement, _, marker = line.partition(";")
        name = re.match(r"[A-Za-z0-9_.-]*", requirement.strip()).group()
        if name == package and re.search(rf"""extra\s*==\s*["']{extra}["']""", marker):
            return requirement.strip().replace(" ", "")
    return package


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The hint for a module that multigpu may need but does not require: the framework's own package, which pip
    installs from PyPI (multigpu's extras are in its pyproject.toml, for a checkout: ``pip install -e ".[jax]"``)."""
    top = (exc.name or "").split(".")[0]
    if top in _EXTRAS:
        extra, package = _EXTRAS[top]
        return (f"{top} is not installed; install it with: pip install '{_pinned(extra, package)}'"
                + (" (or choose another backend with KERAS_BACKEND)" if extra != "plot" else ""))
    return None


def main(argv: list[str] | None = None) -> int:
    print_always()
    parser = build_parser()
    args = parser.parse_args(join_device_lists(list(sys.argv[1:] if argv is None else argv)))
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"multigpu {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        hint = _missing_extra(exc)
        if hint is None:
            raise
        print(f"multigpu {args.command}: error: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
