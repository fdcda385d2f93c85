"""A device lost mid-epoch: how long the survivors take to go on, and how fast they go after it.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_faults.py     # ~5 min
    KERAS_BACKEND=tensorflow OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_faults.py --ways shrink,survivors

Three devices train the convnet of ``_input_worker.py`` (width 2, in-memory images, global batch 128,
``--steps`` steps an epoch, 3 epochs, SGD) at fixed ratios 1:2:1: ``cpu:0`` and ``cpu:1`` on a core
each, and ``cpu:2`` sharing core 0 with ``cpu:0``.  Rank 2 kills itself (``SIGKILL``) as it begins
step ``--kill-at`` of epoch 2, once per run.  Three ways:

* ``shrink``: ``multigpu run --min-devices 2``: the two survivors redo the step and go on;
* ``survivors``: a fresh run on the survivors alone (``cpu:0,cpu:1`` at 1:2, the shares the shrunk
  run goes on with), no fault: what the shrunk run should match after the loss;
* ``restart``: ``multigpu run --max-restarts 1`` with ``keras.callbacks.BackupAndRestore`` (a backup
  per epoch): every rank restarts, and the run resumes after epoch 1;
* ``rejoin``: ``multigpu run --min-devices 2 --max-restarts 1``, over 8 epochs: the survivors go on,
  rank 2's process is started again and rejoins; samples/s of its last epoch (all three devices again,
  checked) against the same run's before the loss.

Printed and written to ``benchmarks/faults/faults.json``: the time from the death (the supervisor's
record of it, within 50 ms of it; under restart, the end of the last step before it) to the end of the
first step after it; samples/s before the loss
(epoch 2's steps before it) and after it (the steps of epoch 3), against the fresh run on the
survivors over the same steps; and each way's time to finish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_faults_worker.py"
BATCH = 128
REJOIN_EPOCHS = 8  # rank 2's new process is ready about 9 s after its death, epochs before the last one


def _run(devices: str, ratios: str, extra: list[str], worker: list[str], env_extra: dict, folder: Path,
         name: str) -> dict:
    marks, out = folder / f"{name}.marks", folder / f"{name}.json"
    cmd = [sys.executable, "-m", "multigpu", "run", "--devices", devices, "--ratios", ratios, *extra,
           str(WORKER), "--marks", str(marks), "--out", str(out), *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "torch"),
           **env_extra}
    began = time.time()
    res = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=900, cwd=folder)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [line.split() for line in marks.read_text().splitlines()]
    return {"began": began, "ended": time.time(), "marks": [(float(t), int(e), int(s)) for t, e, s in rows],
            "out": json.loads(out.read_text()), "log": res.stderr + res.stdout}


def _rate(marks: list, epoch: int, first: int, last: int) -> float:
    """Samples/s over steps ``first``..``last`` of ``epoch`` (from the end of step ``first - 1``)."""
    t = {(e, s): at for at, e, s in marks}
    return (last - first + 1) * BATCH / (t[(epoch, last)] - t[(epoch, first - 1)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=15, help="the step of epoch 2 (from 1) rank 2 dies at")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ways", default="shrink,survivors,restart,rejoin",
                   help="which runs, comma-separated (shrink and survivors always)")
    p.add_argument("--out", default=None, help="default: benchmarks/faults/faults[-BACKEND].json")
    a = p.parse_args()
    backend = os.environ.get("KERAS_BACKEND", "torch")
    ways = set(a.ways.split(",")) | {"shrink", "survivors"}
    out = Path(a.out or ROOT / "benchmarks" / "faults" / f"faults{'' if backend == 'torch' else '-' + backend}.json")
    worker = ["--steps", str(a.steps), "--epochs", "3"]
    dying = [*worker, "--die-at", str(a.steps + a.kill_at)]
    steady = (5, a.steps - 1)  # epoch 3's steps, after the first few
    rounds = []
    for _ in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
            folder = Path(tmp)
            shrink = _run("cpu:0,cpu:1,cpu:2", "1,2,1", ["--min-devices", "2"], dying, {}, folder, "shrink")
            fresh = _run("cpu:0,cpu:1", "1,2", [], worker, {}, folder, "survivors")
            restart = rejoin = None
            if "restart" in ways:
                restart = _run("cpu:0,cpu:1,cpu:2", "1,2,1", ["--max-restarts", "1"],
                               [*dying, "--backup", str(folder / "backup")], {}, folder, "restart")
            if "rejoin" in ways:
                rejoin = _run("cpu:0,cpu:1,cpu:2", "1,2,1", ["--min-devices", "2", "--max-restarts", "1"],
                              ["--steps", str(a.steps), "--epochs", str(REJOIN_EPOCHS), "--die-at",
                               str(a.steps + a.kill_at)], {}, folder, "rejoin")
        death = shrink["out"]["lost"][0]["at"]
        after = next(at for at, _, _ in shrink["marks"] if at > death)
        row = {
            "seconds_from_death_to_next_step": after - death,
            "before_samples_per_second": _rate(shrink["marks"], 1, 3, a.kill_at - 2),
            "after_samples_per_second": _rate(shrink["marks"], 2, *steady),
            "survivors_samples_per_second": _rate(fresh["marks"], 2, *steady),
            "seconds_to_finish": {"shrink": shrink["ended"] - shrink["began"],
                                  "survivors": fresh["ended"] - fresh["began"]},
            "shares_after": shrink["out"]["ratios"],
        }
        if restart is not None:
            # The first attempt's last step before the death, then the restarted run's first step (it resumes
            # epoch 2).
            marks = restart["marks"]
            last = next(i for i, (_, e, s) in enumerate(marks) if (e, s) == (1, a.kill_at - 2))
            restart_death, restarted = marks[last][0], marks[last + 1][0]
            assert (marks[last + 1][1], marks[last + 1][2]) == (1, 0), marks[last + 1]
            row["restart_seconds_from_death_to_next_step"] = restarted - restart_death
            row["restart_steps_done_again"] = sum(1 for _, e, _ in restart["marks"] if e == 1) - a.steps
            row["seconds_to_finish"]["restart"] = restart["ended"] - restart["began"]
        if rejoin is not None:
            row["rejoin_seconds_from_death_to_ready"] = (rejoin["out"]["joined"][0]["at"]
                                                         - rejoin["out"]["lost"][0]["at"])
            row["rejoin_before_samples_per_second"] = _rate(rejoin["marks"], 1, 3, a.kill_at - 2)
            row["rejoin_after_samples_per_second"] = _rate(rejoin["marks"], REJOIN_EPOCHS - 1, *steady)
            row["rejoin_shares_after"] = rejoin["out"]["ratios"]
            row["rejoin_after_vs_before"] = (row["rejoin_after_samples_per_second"]
                                             / row["rejoin_before_samples_per_second"])
            # The last epoch's rate is of all three devices only if rank 2 was back before its measured steps.
            began = next(at for at, e, s in rejoin["marks"] if (e, s) == (REJOIN_EPOCHS - 1, steady[0] - 1))
            if not rejoin["out"]["joined"] or rejoin["out"]["joined"][0]["at"] > began:
                raise SystemExit(f"rank 2 was not back before the last epoch's measured steps: {rejoin['out']}")
        row["after_vs_survivors"] = row["after_samples_per_second"] / row["survivors_samples_per_second"]
        rounds.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in ("seconds_from_death_to_next_step", "before_samples_per_second", "after_samples_per_second",
                        "survivors_samples_per_second", "after_vs_survivors",
                        "restart_seconds_from_death_to_next_step", "restart_steps_done_again",
                        "rejoin_seconds_from_death_to_ready", "rejoin_after_vs_before") if k in rounds[0]]
    summary = {k: statistics.median(r[k] for r in rounds) for k in keys}
    summary["seconds_to_finish"] = {w: statistics.median(r["seconds_to_finish"][w] for r in rounds)
                                    for w in rounds[0]["seconds_to_finish"]}
    print("median of", len(rounds), "rounds:")
    for k, v in summary.items():
        print(f"  {k}: {v if isinstance(v, dict) else round(v, 3)}")
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "backend": backend,
                               "cores": os.cpu_count(), "steps": a.steps, "kill_at": a.kill_at,
                               "rounds": rounds, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
