"""Automatic shares that may set a device aside, against one device alone, side by side.

For each case (model:width:global batch:steps an epoch), in ``--rounds`` interleaved rounds of fresh processes:
plain Keras ``fit`` on one core (``single``), multigpu on ``cpu:0`` and ``cpu:1`` with ``ratios="auto"`` from a
fresh profile (``auto``), and the same never setting a device aside (``kept``: ``MULTIGPU_PARK=off``), each for
``--epochs`` epochs (``--second cpu:1@0.2``: a second device at a fifth of a core; ``--first cpu:0@0.2``: the
first one, the leader, at a fifth; ``--third cpu:2@0.1``: a third device, at a tenth of a core,
beside the first two, and ``pair``: automatic shares on the first two alone).  The figure is the samples/s
of the last three epochs; the ratios are auto / single and kept / single of the medians.  A run that set a
device aside says so in its log (counted here).

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/parking/bench_park.py
    KERAS_BACKEND=tensorflow ... benchmarks/parking/bench_park.py --cases mlp:0.5:64:80
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ["mlp:0.5:64:80", "mlp:0.5:512:30", "convnet:0.25:256:12"]


def run(mode: str, case: str, epochs: int, folder: str, second: str = "cpu:1", first: str = "cpu:0",
        third: str | None = None) -> dict:
    name, width, batch, steps = case.split(":")
    out = os.path.join(folder, "out.json")
    if os.path.exists(out):
        os.remove(out)
    profile = os.path.join(folder, "profiles.json")
    if os.path.exists(profile):
        os.remove(profile)  # a fresh profile every run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTIGPU_PROFILE": profile, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if mode == "kept":  # automatic shares that never set a device aside (multigpu.balancing.parking)
        mode, env["MULTIGPU_PARK"] = "auto", "off"
    if mode == "pair":  # the first two devices without the third
        mode, third = "auto", None
    command = [sys.executable, os.path.join(HERE, "_park_script.py"), mode, name, width, batch, steps, str(epochs), out,
               second, first, *([third] if third else [])]
    if mode == "single":
        command = ["taskset", "-c", "0", *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(out) as f:
        result = json.load(f)
    result["aside"] = sum("set aside from epoch" in line for line in proc.stdout.splitlines())
    result["back"] = sum(" back after epoch" in line for line in proc.stdout.splitlines())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--second", default="cpu:1", help="the second device (cpu:1@0.2: a fifth of a core)")
    parser.add_argument("--first", default="cpu:0", help="the first device, the leader (cpu:0@0.2: a fifth)")
    parser.add_argument("--third", default=None, help="a third device (cpu:2@0.1: a tenth of a core)")
    args = parser.parse_args()
    backend = os.environ.get("KERAS_BACKEND", "torch")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            modes = ("single", "auto", "kept", *(["pair"] if args.third else []))
            got: dict[str, list[dict]] = {mode: [] for mode in modes}
            for r in range(args.rounds):
                for mode in modes:
                    res = run(mode, case, args.epochs, folder, args.second, args.first, args.third)
                    got[mode].append(res)
                    extra = (f", shares {'/'.join(f'{v:.0%}' for v in res['shares'])}, set aside {res['aside']}x, "
                             f"back {res['back']}x") if mode != "single" else ""
                    j = res.get("judgment")
                    if mode == "auto" and j:  # the judgment's figures (multigpu.state(model).judgment)
                        who = f"{j['device']} alone"
                        if "devices" in j:  # more than one device left
                            who = f"{', '.join(j['devices'])} without the rest"
                        extra += (f" (judged: {who} {j['alone']:.0f} to "
                                  f"{j.get('ceiling', j['alone']):.0f}, "
                                  f"together {j['together']:.0f}{', a trial' if j.get('trial') else ''})")
                    print(f"{backend} {case} round {r + 1} {mode:>6}: {res['samples_per_second']:8.0f} samples/s"
                          f"{extra}", flush=True)
            single = statistics.median(v["samples_per_second"] for v in got["single"])
            auto = statistics.median(v["samples_per_second"] for v in got["auto"])
            kept = statistics.median(v["samples_per_second"] for v in got["kept"])
            devices = " and ".join([args.first, args.second, *([args.third] if args.third else [])])
            pair = statistics.median(v["samples_per_second"] for v in got["pair"]) if args.third else None
            print(f"{backend} {case} on {devices}: auto / single (medians of {args.rounds}): "
                  f"{auto / single:.3f}x ({auto:.0f} against {single:.0f} samples/s); without setting a device "
                  f"aside {kept / single:.3f}x ({kept:.0f})"
                  + (f"; the first two alone {pair / single:.3f}x ({pair:.0f})" if pair else ""), flush=True)


if __name__ == "__main__":
    main()
