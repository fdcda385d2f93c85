"""One rank of a parallel Keras-suite run: the same pytest selection on every rank.

    multigpu run --devices cpu:0,cpu:1 keras_suite/rank.py OUT_DIR TESTS_FILE

``TESTS_FILE`` holds one pytest node id per line, in order.  Each rank writes its outcomes to
``OUT_DIR/rank{R}.jsonl`` (see ``plugin.py``); files saved by the tests go to
``OUT_DIR/shared``, the same folder on every rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import pytest
from plugin import Recorder

import multigpu


def main() -> int:
    out, tests = Path(sys.argv[1]), Path(sys.argv[2]).read_text().split()
    devices = os.environ.get("KERAS_SUITE_DEVICES", "cpu:0,cpu:1").split(",")
    rank = multigpu.rank()
    recorder = Recorder(out / f"rank{rank}.jsonl", out / "shared", devices,
                        float(os.environ.get("KERAS_SUITE_TIMEOUT", "20")))
    recorder.install()
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--basetemp", str(out / f"tmp-rank{rank}"),
            "-o", "addopts=", "-W", "ignore", *tests]
    if rank != 0:
        args.insert(0, "--capture=sys")
    code = pytest.main(args, plugins=[recorder])
    # Test failures are the suite's result, not the run's: only a broken run ends with an error.
    return 0 if code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) else int(code)


if __name__ == "__main__":
    sys.exit(main())
