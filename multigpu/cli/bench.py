"""``multigpu bench``: samples/s per device, sweeps, baselines.

    multigpu bench --devices 0 1 --batches 512 355 --model convnet
    multigpu bench --devices cpu:0 cpu:1@0.5 --batch-size 256 --ratios auto --baseline single,ddp,keras-ddp
    multigpu bench --sweep 64,128,256,512,1024 --devices cpu:0 cpu:1 --model gru --out results/
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from multigpu import backend
from multigpu.bench.models import names
from multigpu.planning.shares import parse_ratios

BASELINES = {"single": "plain model.fit on one device", "ddp": "PyTorch DDP loop, equal shares",
             "keras-ddp": "Keras fit wrapped in DDP, equal shares",
             "keras-fit-ddp": "Keras 3.16's own DDP fit under a process group, equal shares"}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure samples/s per device, sweep batch sizes, compare baselines",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", "--gpus", default="auto",
                   help="devices, e.g. 0,1 or 0 1 or cpu:0 cpu:1@0.5 (default: auto, every GPU)")
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="local batch per device, e.g. 512 355 (sets the global batch and the ratios)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch size (default 256)")
    p.add_argument("--ratios", default=None, help="auto or comma-separated ratios (default: equal)")
    p.add_argument("--model", default="convnet",
                   help="a built-in model (" + ", ".join(names()) + ") or file.py:fn")
    p.add_argument("--width", type=float, default=1.0, help="scale the model's layer widths")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--compression", default=None, choices=["bf16", "fp16"], help="send gradients in 16 bits")
    p.add_argument("--sweep", default=None, help="comma-separated global batch sizes")
    p.add_argument("--baseline", default="", help=f"comma-separated: {', '.join(BASELINES)}")
    p.add_argument("--no-solo", action="store_true", help="skip the solo runs (no balance efficiency)")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON, Markdown and PNG results")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    from multigpu.bench.models import get_model
    from multigpu.devices import parse_devices

    if args.steps < 2 or args.warmup < 1:
        raise ValueError(f"--steps must be >= 2 and --warmup >= 1. Received: {args.steps}, {args.warmup}")
    devices = parse_devices(args.devices, num_gpus=backend.gpu_count)
    if args.batches is not None:
        if len(args.batches) != len(devices):
            raise ValueError(
                f"--batches needs one size per device: {len(devices)} devices, "
                f"{len(args.batches)} batches. Received: --batches {' '.join(map(str, args.batches))}"
            )
        if any(b <= 0 for b in args.batches):
            raise ValueError(f"--batches must be positive. Received: {args.batches}")
        if args.batch_size is not None or args.ratios is not None:
            raise ValueError("give either --batches, or --batch-size with --ratios, not both")
    if args.batch_size is not None and args.batch_size <= 0:
        raise ValueError(f"--batch-size must be positive. Received: {args.batch_size}")
    if args.ratios is not None:
        parse_ratios(args.ratios, len(devices))
    from multigpu.bench.runs import BASELINE_MODES, baselines_file

    for name in filter(None, args.baseline.split(",")):
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; allowed: {', '.join(BASELINES)}")
        if name in BASELINE_MODES and baselines_file() is None:
            raise ValueError(f"--baseline {name}: the other frameworks' loops are laboratory code kept in the "
                             "repository's benchmarks/baselines.py, not installed; run from a checkout of multigpu")
    if args.sweep:
        try:
            sizes = [int(s) for s in args.sweep.split(",")]
        except ValueError:
            raise ValueError(f"--sweep takes comma-separated sizes. Received: {args.sweep!r}") from None
        if any(s <= 0 for s in sizes):
            raise ValueError(f"--sweep sizes must be positive. Received: {args.sweep}")
    get_model(args.model)


def _count(args: argparse.Namespace) -> int:
    """How many devices ``--devices`` names."""
    from multigpu.devices import parse_devices

    return len(parse_devices(args.devices, num_gpus=backend.gpu_count))


def _ratios(args, n: int):
    if args.ratios is None:
        return None
    spec = parse_ratios(args.ratios, n)
    return list(spec.values) if spec.kind == "fixed" else spec.text()


def _base_config(args, batch: int, ratios) -> dict:
    from multigpu.devices import parse_devices

    devices = parse_devices(args.devices, num_gpus=backend.gpu_count)
    return {
        "mode": "multigpu", "model": args.model, "width": args.width,
        "devices": [d.spec for d in devices], "batch": batch, "ratios": ratios,
        "steps": args.steps, "warmup": args.warmup, "print_every": 0, "compression": args.compression,
    }


def _where_time_goes(result: dict) -> list[str]:
    report = result.get("report") or {}
    lines = []
    for row in report.get("devices", []):
        total = row["data"] + row["compute"] + row["wait"] or 1.0
        waited = row.get("input", 0.0)
        lines.append(f"  {row['device']:<12} input {waited / total:>4.0%}  loop {(row['data'] - waited) / total:>4.0%}"
                     f"  compute {row['compute'] / total:>4.0%}  waiting {row['wait'] / total:>4.0%}")
    return lines


def _who_pays(result: dict) -> tuple[str, dict] | None:
    """Which devices pay at this model and batch, judged as automatic shares judge an epoch (the steps of the
    device that would compute fastest alone, the first unless another beats it by the margin: fixed work and
    rows at its speed, grown to the whole batch, against the devices together;
    :meth:`multigpu.balancing.parking.Parking.choose`, a group of devices included), from the run's epoch report;
    None without one."""
    from types import SimpleNamespace

    from multigpu.balancing.parking import MARGIN, Parking

    rows = (result.get("report") or {}).get("devices") or []
    if len(rows) < 2 or not all(r.get("samples") and r.get("samples_per_second") for r in rows):
        return None
    e = {"samples": [r["samples"] for r in rows], "compute": [r["compute"] for r in rows],
         "wall": [r["samples"] / r["samples_per_second"] for r in rows], "steps": rows[0]["steps"],
         "sum": max(r.get("sum", 0.0) for r in rows)}
    # (a group of devices may stay where the steps sum over part of the ranks: not JAX's XLA sums, on GPUs)
    groups = backend.facts().sums_among_gpus or all(r["device"].startswith("CPU") for r in rows)
    left, verdict = Parking.choose(e, 0, None, [SimpleNamespace(label=r["device"]) for r in rows], groups=groups)
    leader = left[0] if left else Parking.keeper(e, 0, None)  # the device that would stay were the others aside
    others = ", ".join(r["device"] for i, r in enumerate(rows) if i not in (left or [leader]))
    if len(left) > 1:
        verb = "does" if len(rows) - len(left) == 1 else "do"
        line = (f"which devices pay: {', '.join(verdict['devices'])} ({others} {verb} not): without the rest they "
                f"would compute about {verdict['alone']:.0f} samples/s at this batch, at least {MARGIN:g}x the "
                f"{verdict['together']:.0f} the devices ran together; with ratios='auto' a fit sets the rest aside "
                "from its second epoch")
    elif verdict["pays"]:
        line = (f"which devices pay: all of them ({verdict['device']} alone would compute about "
                f"{verdict['alone']:.0f} samples/s at this batch, the devices together ran {verdict['together']:.0f})")
    elif verdict["trial"]:
        low, high = f"{verdict['alone']:.0f}", f"{verdict['ceiling']:.0f}"
        span = f"{low} to {high}" if low != high else f"about {low}"
        line = (f"which devices pay: perhaps {verdict['device']} alone: it would compute {span} samples/s at this "
                f"batch, the devices together ran {verdict['together']:.0f}; with ratios='auto' a fit sets {others} "
                f"aside from its second epoch to try, and takes {'it' if len(rows) == 2 else 'them'} back after an "
                "epoch alone ran slower")
    else:
        line = (f"which devices pay: {verdict['device']} alone ({others} {'does' if len(rows) == 2 else 'do'} not): "
                f"it would compute about "
                f"{verdict['alone']:.0f} samples/s at this batch, at least {MARGIN:g}x the {verdict['together']:.0f} "
                "the devices ran together; with ratios='auto' a fit sets them aside from its second epoch")
    return line, verdict


def _first_cores(config: dict) -> list[int]:
    from multigpu.devices import assign_cores, parse_devices

    return list(assign_cores(parse_devices(config["devices"], num_gpus=backend.gpu_count), warn=False)[0].cores)


def run(args: argparse.Namespace) -> int:
    from multigpu.balancing.search import balance_efficiency
    from multigpu.bench.runs import run_config, run_in_turn, solo_devices_config
    from multigpu.planning.shares import split

    _check(args)
    if args.sweep:
        return _sweep(args)
    n = _count(args)
    if args.batches is not None:
        batch, ratios = sum(args.batches), [float(b) for b in args.batches]
    else:
        batch, ratios = args.batch_size or 256, _ratios(args, n)
    config = _base_config(args, batch, ratios)
    config["print_every"] = batch * max(1, args.steps // 4)
    print(f"multigpu bench: model {args.model} (width {args.width:g}), global batch {batch}, "
          f"devices {' '.join(config['devices'])}, {args.steps} timed steps", flush=True)
    main = run_config(config, args.timeout)
    summary = {"multigpu": main, "baselines": {}, "solo": []}
    print(f"\nmultigpu: {main['samples_per_second']:.1f} samples/s in total "
          f"(gradients summed through {main.get('transport', '?')})", flush=True)
    if len(config["devices"]) > 1 and not args.no_solo:
        shares = main.get("shares") or split(batch, ratios if isinstance(ratios, list) else [1.0] * n)
        solos = solo_devices_config(config, shares)  # one at a time, their processes started at once
        for solo, result in zip(solos, run_in_turn([dict(solo, print_every=0) for solo in solos], args.timeout)):
            summary["solo"].append(result)
            print(f"  solo {solo['label']}[{solo['batch']}]: {result['samples_per_second']:.1f} samples/s",
                  flush=True)
        summary["balance_efficiency"] = balance_efficiency(
            main["samples_per_second"], [r["samples_per_second"] for r in summary["solo"]])
        print(f"balance efficiency: {summary['balance_efficiency']:.3f} "
              "(total samples/s over the sum of each device's solo samples/s)")
    lines = _where_time_goes(main)
    if lines:
        print("where the time goes (share of each device's step time):")
        print("\n".join(lines))
    for name in filter(None, args.baseline.split(",")):
        cfg = dict(config, mode=name, print_every=0, ratios=None)
        if name == "single":  # on the first device's own cores, as in the parallel run
            cfg["devices"], cfg["cores"] = config["devices"][:1], _first_cores(config)
        result = run_config(cfg, args.timeout, stream=False)
        summary["baselines"][name] = result
        ratio = main["samples_per_second"] / result["samples_per_second"]
        print(f"baseline {name} ({BASELINES[name]}): {result['samples_per_second']:.1f} samples/s; "
              f"multigpu is {ratio:.2f}x", flush=True)
    judged = _who_pays(main)
    if judged:
        summary["judgment"] = judged[1]
        print(judged[0], flush=True)
    single = summary["baselines"].get("single")
    if single and n > 1 and main["samples_per_second"] < single["samples_per_second"]:
        print(f"note: at a global batch of {batch} the {n} devices are slower than one device alone "
              f"({main['samples_per_second']:.0f} against {single['samples_per_second']:.0f} samples/s): "
              "communication and per-step work cost more than they save. "
              "`multigpu bench --sweep` finds the batch from which they pay.")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out / 'bench.json'}")
    return 0


def break_even(rows: list[dict]) -> int | None:
    """The smallest batch size of a sweep from which every larger one runs faster on all devices than on one."""
    sizes = sorted({r["batch_size"] for r in rows})
    many = {r["batch_size"]: r["speedup"] for r in rows if r["devices"] > 1}
    paying = [s for s in sizes if many.get(s, 0.0) > 1.0]
    for s in sizes:
        if s in many and all(many.get(t, 0.0) > 1.0 for t in sizes if t >= s):
            return s
    return paying[0] if paying else None


def _sweep(args) -> int:
    from multigpu.bench.runs import run_config

    sizes = [int(s) for s in args.sweep.split(",")]
    ratios = _ratios(args, _count(args))
    rows = []
    epoch_rows = 60000
    for size in sizes:
        base = _base_config(args, size, ratios)
        one = run_config(dict(base, mode="solo", devices=base["devices"][:1], ratios=None,
                              cores=_first_cores(base)), args.timeout, stream=False)
        runs = [(1, one)]
        if len(base["devices"]) > 1:
            runs.append((len(base["devices"]), run_config(base, args.timeout, stream=False)))
        for count, result in runs:
            sps = result["samples_per_second"]
            rows.append({
                "batch_size": size, "devices": count, "samples_per_second": sps,
                "time_per_epoch": epoch_rows / sps if sps else math.nan,
                "speedup": sps / one["samples_per_second"], "loss": result["loss"],
            })
            print(f"batch {size:>5}  devices {count}  {sps:>9.1f} samples/s  "
                  f"speedup {rows[-1]['speedup']:.2f}x", flush=True)
    even = break_even(rows)
    table = ["| batch size | devices | time per epoch (s) | samples/s | speed up | final loss |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (pays from here)" if r["batch_size"] == even and r["devices"] > 1 else ""
        table.append(f"| {r['batch_size']} | {r['devices']} | {r['time_per_epoch']:.1f} | "
                     f"{r['samples_per_second']:.1f} | {r['speedup']:.2f}{mark} | {r['loss']:.4f} |")
    print("\n" + "\n".join(table))
    print(f"(time per epoch: {epoch_rows} samples at the measured rate)")
    if _count(args) > 1:
        print(f"break-even: from a global batch of {even} the devices together are faster than one alone"
              if even is not None else "break-even: at none of these batch sizes are the devices together faster "
              "than one alone; try larger batches")
    out = args.out or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    specs = _base_config(args, 0, None)["devices"]
    (out / "sweep.json").write_text(json.dumps({"model": args.model, "devices": specs, "rows": rows,
                                                "break_even": even}, indent=2))
    (out / "sweep.md").write_text("\n".join(table) + "\n")
    written = [out / "sweep.json", out / "sweep.md"]
    if _plot(rows, out / "sweep.png", args.model, even):
        written.append(out / "sweep.png")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _plot(rows, path: Path, title: str, even: int | None) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("time_per_epoch", "time per epoch (s)"), ("samples_per_second", "samples/s"),
              ("speedup", "speed up vs 1 device"), ("loss", "final loss")]
    for ax, (key, label) in zip(axes.flat, panels):
        for count in sorted({r["devices"] for r in rows}):
            pts = [(r["batch_size"], r[key]) for r in rows if r["devices"] == count]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{count} device(s)")
        if even is not None:
            ax.axvline(even, color="gray", linestyle="--", linewidth=1, label="break-even")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"multigpu bench --sweep: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
