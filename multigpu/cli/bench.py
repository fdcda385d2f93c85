"""``multigpu bench``: samples/s per device, sweeps, baselines.

    multigpu bench --devices 0 1 --batches 512 355 --model convnet
    multigpu bench --devices cpu:0 cpu:1@0.5 --batch-size 256 --ratios auto --baseline single,ddp
    multigpu bench --sweep 64,128,256,512,1024 --devices cpu:0 cpu:1 --model gru --out results/
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from multigpu.cli.run import parse_ratios


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure samples/s per device, sweep batch sizes, compare baselines")
    p.add_argument("--devices", "--gpus", nargs="+", default=["auto"],
                   help="devices, e.g. 0 1 or cpu:0 cpu:1@0.5 (default: auto)")
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="local batch per device, e.g. 512 355 (sets the global batch and the ratios)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch size (default 256)")
    p.add_argument("--ratios", default=None, help="auto or comma-separated ratios (default: equal)")
    p.add_argument("--model", default="convnet", help="convnet, mlp, gru, maxing, dense41m or file.py:fn")
    p.add_argument("--width", type=float, default=1.0, help="scale the model's layer widths")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--sweep", default=None, help="comma-separated global batch sizes")
    p.add_argument("--baseline", default="", help="comma-separated: single, ddp")
    p.add_argument("--no-solo", action="store_true", help="skip the solo runs (no balance efficiency)")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON, Markdown and PNG results")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    from multigpu.devices import parse_devices
    from multigpu.models import get_model

    if args.steps < 2 or args.warmup < 1:
        raise ValueError(f"--steps must be >= 2 and --warmup >= 1. Received: {args.steps}, {args.warmup}")
    devices = parse_devices(args.devices)
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
    if args.ratios not in (None, "auto"):
        parse_ratios(args.ratios, len(devices))
    for name in filter(None, args.baseline.split(",")):
        if name not in ("single", "ddp"):
            raise ValueError(f"unknown baseline {name!r}; allowed: single, ddp")
    if args.sweep:
        try:
            sizes = [int(s) for s in args.sweep.split(",")]
        except ValueError:
            raise ValueError(f"--sweep takes comma-separated sizes. Received: {args.sweep!r}") from None
        if any(s <= 0 for s in sizes):
            raise ValueError(f"--sweep sizes must be positive. Received: {args.sweep}")
    get_model(args.model)


def _base_config(args, batch: int, ratios) -> dict:
    from multigpu.devices import parse_devices

    return {
        "mode": "multigpu", "model": args.model, "width": args.width,
        "devices": [d.spec for d in parse_devices(args.devices)], "batch": batch, "ratios": ratios,
        "steps": args.steps, "warmup": args.warmup, "print_every": 0,
    }


def _where_time_goes(result: dict) -> list[str]:
    report = result.get("report") or {}
    lines = []
    for row in report.get("devices", []):
        total = row["data"] + row["compute"] + row["wait"] or 1.0
        lines.append(f"  {row['device']:<12} data {row['data'] / total:>4.0%}  compute "
                     f"{row['compute'] / total:>4.0%}  waiting {row['wait'] / total:>4.0%}")
    return lines


def run(args: argparse.Namespace) -> int:
    from multigpu.balance import balance_efficiency
    from multigpu.bench import run_config, solo_devices_config
    from multigpu.planning import split

    _check(args)
    if args.sweep:
        return _sweep(args)
    if args.batches is not None:
        batch, ratios = sum(args.batches), [float(b) for b in args.batches]
    else:
        batch = args.batch_size or 256
        ratios = "auto" if args.ratios == "auto" else (
            None if args.ratios is None else parse_ratios(args.ratios, len(args.devices)))
    config = _base_config(args, batch, ratios)
    config["print_every"] = batch * max(1, args.steps // 4)
    print(f"multigpu bench: model {args.model} (width {args.width:g}), global batch {batch}, "
          f"devices {' '.join(config['devices'])}, {args.steps} timed steps", flush=True)
    main = run_config(config, args.timeout)
    summary = {"multigpu": main, "baselines": {}, "solo": []}
    n = len(config["devices"])
    print(f"\nmultigpu: {main['samples_per_second']:.1f} samples/s in total", flush=True)
    if n > 1 and not args.no_solo:
        shares = main.get("shares") or split(batch, ratios if isinstance(ratios, list) else [1.0] * n)
        for solo in solo_devices_config(config, shares):
            result = run_config(dict(solo, print_every=0), args.timeout, stream=False)
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
            from multigpu.devices import assign_cores, parse_devices

            cfg["devices"] = config["devices"][:1]
            cfg["cores"] = list(assign_cores(parse_devices(config["devices"]))[0].cores)
        result = run_config(cfg, args.timeout, stream=False)
        summary["baselines"][name] = result
        ratio = main["samples_per_second"] / result["samples_per_second"]
        label = "plain model.fit on one device" if name == "single" else "PyTorch DDP, equal shares"
        print(f"baseline {name} ({label}): {result['samples_per_second']:.1f} samples/s; "
              f"multigpu is {ratio:.2f}x", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out / 'bench.json'}")
    return 0


def _sweep(args) -> int:
    from multigpu.bench import run_config

    sizes = [int(s) for s in args.sweep.split(",")]
    ratios = "auto" if args.ratios == "auto" else (
        None if args.ratios is None else parse_ratios(args.ratios, len(args.devices)))
    rows = []
    epoch_rows = 60000
    for size in sizes:
        base = _base_config(args, size, ratios)
        from multigpu.devices import assign_cores, parse_devices

        first = assign_cores(parse_devices(base["devices"]))[0]
        one = run_config(dict(base, mode="solo", devices=base["devices"][:1], ratios=None,
                              cores=list(first.cores)), args.timeout, stream=False)
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
    table = ["| batch size | devices | time per epoch (s) | samples/s | speed up | final loss |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['batch_size']} | {r['devices']} | {r['time_per_epoch']:.1f} | "
                     f"{r['samples_per_second']:.1f} | {r['speedup']:.2f} | {r['loss']:.4f} |")
    print("\n" + "\n".join(table))
    print(f"(time per epoch: {epoch_rows} samples at the measured rate)")
    out = args.out or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"model": args.model, "devices": args.devices, "rows": rows},
                                               indent=2))
    (out / "sweep.md").write_text("\n".join(table) + "\n")
    _plot(rows, out / "sweep.png", args.model)
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}")
    return 0


def _plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("time_per_epoch", "time per epoch (s)"), ("samples_per_second", "samples/s"),
              ("speedup", "speed up vs 1 device"), ("loss", "final loss")]
    for ax, (key, label) in zip(axes.flat, panels):
        for count in sorted({r["devices"] for r in rows}):
            pts = [(r["batch_size"], r[key]) for r in rows if r["devices"] == count]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{count} device(s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"multigpu bench --sweep: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
