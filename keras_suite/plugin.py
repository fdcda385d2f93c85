"""The pytest plugin each process of the Keras suite runs with: records outcomes, parallelizes models.

Loaded by ``keras_suite/rank.py`` (parallel runs, every rank) and by ``keras_suite/run.py``'s
plain reference run.  It appends one JSON line per finished test to ``PROGRESS``:
``{"id", "outcome", "reached", "reason"}``, flushed at once, so that the driver knows how far a
run got when it ended early.  ``reached`` says whether the test compiled a ``keras.Model`` (and
so, in a parallel run, trained it through multigpu).

In a parallel run, ``keras.Model.compile`` first passes the model to
``multigpu.parallelize(model, devices=DEVICES, timeout=TIMEOUT)``, as a user's script would,
and Keras's ``TestCase.get_temp_dir`` gives every rank the same folder for the same call, so
that a file rank 0 saves is the file every rank loads.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest


class Recorder:
    """Outcome of each test, one JSON line per test in ``progress``."""

    def __init__(self, progress: Path, shared_tmp: Path | None, devices: list[str] | None, timeout: float) -> None:
        self.progress = progress
        self.shared_tmp = shared_tmp
        self.devices = devices
        self.timeout = timeout
        self.reached = False
        self.outcome: dict[str, tuple[str, str]] = {}
        self.temp_calls = 0
        self.current = ""

    # ----------------------------------------------------------- patching
    def install(self) -> None:
        """Wraps ``keras.Model.compile`` (parallel runs) and notes which tests compile a model."""
        import keras
        from keras.src.testing import test_case

        recorder = self
        original = keras.Model.compile

        def compile(model, *args, **kwargs):
            recorder.reached = True
            if recorder.devices is not None:
                import multigpu
                from multigpu.keras.parallel import is_parallel

                if not is_parallel(model):
                    multigpu.parallelize(model, devices=recorder.devices, timeout=recorder.timeout)
            return original(model, *args, **kwargs)

        keras.Model.compile = compile
        if self.shared_tmp is not None:
            def get_temp_dir(case) -> str:
                recorder.temp_calls += 1
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", recorder.current)[-120:]
                path = self.shared_tmp / f"{name}-{recorder.temp_calls}"
                path.mkdir(parents=True, exist_ok=True)
                return str(path)

            test_case.TestCase.get_temp_dir = get_temp_dir

            def mkdtemp(suffix=None, prefix=None, dir=None) -> str:
                # One path for every rank (ranks make the same calls in the same order), as a script that
                # runs on every rank names one folder: rank 1 reads what rank 0's callbacks wrote there.
                recorder.temp_calls += 1
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", recorder.current)[-120:]
                path = self.shared_tmp / f"{name}-mkdtemp-{recorder.temp_calls}"
                path.mkdir(parents=True, exist_ok=True)
                return str(path)

            tempfile.mkdtemp = mkdtemp

    # -------------------------------------------------------------- hooks
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        self.current = nodeid
        self.reached = False
        self.temp_calls = 0

    def pytest_runtest_logreport(self, report):
        kept = self.outcome.get(report.nodeid)
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            outcome = ("skipped", reason)
        elif report.failed:
            outcome = ("failed", _last_line(report))
        else:
            outcome = ("passed", "")
        # The first failure or skip wins; a later phase's pass does not hide it.
        if kept is None or kept[0] == "passed":
            self.outcome[report.nodeid] = outcome

    def pytest_collectreport(self, report):
        """A test file that cannot be imported (it needs TensorFlow, say) counts as one failed entry."""
        if report.failed:
            line = json.dumps({"id": report.nodeid, "outcome": "failed", "reached": False,
                               "reason": f"cannot be collected: {_last_line(report)}"[:300]})
            with open(self.progress, "a") as f:
                f.write(line + "\n")

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, reason = self.outcome.pop(nodeid, ("failed", "no report"))
        line = json.dumps({"id": nodeid, "outcome": outcome, "reached": self.reached, "reason": reason[:300]})
        with open(self.progress, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.devices is not None and self.reached:
            self._resync(nodeid)

    def _resync(self, nodeid: str) -> None:
        """Ends the run when a test failed on some rank: that rank left the test early, skipping collectives
        the others still make, so every later test would fail for it.  The runner starts again at the next
        test (``resync`` in the output folder tells it that nothing ended the run by itself)."""
        folder = self.progress.parent
        deadline = time.monotonic() + 3 * self.timeout
        outcomes: list[str] = []
        while time.monotonic() < deadline:
            outcomes = []
            for r in range(len(self.devices or [])):
                path = folder / f"rank{r}.jsonl"
                lines = path.read_text().splitlines() if path.exists() else []
                mine = [json.loads(ln)["outcome"] for ln in lines if ln.strip() and json.loads(ln)["id"] == nodeid]
                outcomes.append(mine[-1] if mine else "")
            if all(outcomes):
                break
            time.sleep(0.05)
        if all(o in ("passed", "skipped") for o in outcomes) and all(outcomes):
            return
        (folder / "resync").write_text(nodeid)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)


def _last_line(report) -> str:
    """The exception line of a failure: ``ValueError: ...`` (the last of a chain: the one the test ended on)."""
    text = str(report.longrepr)
    errors = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    for line in reversed(errors):
        if re.match(r"^[A-Za-z_.]+(Error|Exception|Interrupt)\b", line):
            return line
    return errors[0] if errors else text.strip().splitlines()[-1] if text.strip() else "failed"
