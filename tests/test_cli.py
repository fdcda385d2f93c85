"""The command line through its real entry point, with tiny models and few steps."""

import json
import re
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TINY = ["--model", "mlp", "--width", "0.05", "--steps", "3", "--warmup", "1"]


def test_bench_prints_per_device_rates_baselines_and_breakdown(runner):
    res = runner.cli("bench", "--gpus", "cpu:0", "cpu:1", "--batches", "24", "8", *TINY,
                     "--baseline", "single,ddp", "--out", str(runner.tmp_path))
    assert res.returncode == 0, res.stdout
    assert re.search(r"^After \d+ samples$", res.stdout, re.M)
    assert re.search(r"^CPU:0\[24\] \d+ sps$", res.stdout, re.M)
    assert re.search(r"^CPU:1\[8\] \d+ sps$", res.stdout, re.M)
    assert re.search(r"^Total:\[32\] \d+ sps$", res.stdout, re.M)
    assert re.search(r"balance efficiency: \d\.\d{3}", res.stdout)
    assert re.search(r"CPU:1 +input +\d+%  loop +\d+%  compute +\d+%  waiting +\d+%", res.stdout)
    assert re.search(r"baseline single .*multigpu is \d+\.\d\dx", res.stdout)
    assert re.search(r"baseline ddp .*multigpu is \d+\.\d\dx", res.stdout)
    summary = json.loads((runner.tmp_path / "bench.json").read_text())
    assert summary["multigpu"]["samples_per_second"] > 0
    assert summary["multigpu"]["shares"] == [24, 8]
    assert len(summary["solo"]) == 2 and set(summary["baselines"]) == {"single", "ddp"}
    assert runner.leftovers() == []


@pytest.mark.outside  # `make test-outside`: 17 s of runs that the other CLI tests already start
def test_sweep_writes_table_json_markdown_and_png(runner):
    res = runner.cli("bench", "--sweep", "16,32", "--devices", "cpu:0", "cpu:1", *TINY,
                     "--out", str(runner.tmp_path))
    assert res.returncode == 0, res.stdout
    assert "| batch size | devices | time per epoch (s) | samples/s | speed up | final loss |" in res.stdout
    data = json.loads((runner.tmp_path / "sweep.json").read_text())
    assert [(r["batch_size"], r["devices"]) for r in data["rows"]] == [(16, 1), (16, 2), (32, 1), (32, 2)]
    for row in data["rows"]:
        assert row["samples_per_second"] > 0 and row["speedup"] > 0
    assert (runner.tmp_path / "sweep.md").read_text().count("\n") == 6
    png = (runner.tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_calibrate_prints_table_and_writes_profile(runner):
    profile = runner.tmp_path / "p.json"
    res = runner.cli("calibrate", "--devices", "cpu:0", "cpu:1", "--model", "mlp", "--width", "0.05",
                     "--sizes", "8,32", "--profile", str(profile))
    assert res.returncode == 0, res.stdout
    assert "suggested ratios:" in res.stdout and "largest batch that fits" in res.stdout
    # its workers seed as Keras does but leave TensorFlow unimported on torch: none of its start-up lines
    assert "oneDNN" not in res.stdout and "tensorflow" not in res.stdout.lower(), res.stdout[-2000:]
    entry = next(iter(json.loads(profile.read_text())["entries"].values()))
    assert entry["devices"] == ["cpu:0", "cpu:1"] and len(entry["ratios"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--devices", "tpu:0"], "Unknown device 'tpu:0'"),
        (["bench", "--devices", "cpu:0", "cpu:1", "--batches", "8"], "one size per device: 2 devices, 1 batches"),
        (["bench", "--devices", "cpu:0", "cpu:1", "--batches", "8", "-4"], "--batches must be positive"),
        (["bench", "--devices", "cpu:0", "--batch-size", "-3"], "--batch-size must be positive"),
        (["bench", "--devices", "cpu:0", "--model", "nope"], "Unknown model 'nope'"),
        (["bench", "--devices", "cpu:0", "--baseline", "horovod"], "unknown baseline 'horovod'"),
        (["bench", "--devices", "cpu:0", "--sweep", "16,x"], "--sweep takes comma-separated sizes"),
        (["calibrate", "--devices", "cpu:0", "--sizes", "0"], "--sizes must be positive"),
        (["run", "--devices", "cpu:0", "--max-restarts", "-1", "/dev/null"], "--max-restarts must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(runner, args, message):
    res = runner.cli(*args, timeout=60)
    assert res.returncode == 2, res.stdout
    assert message in res.stdout


def test_version_is_printed_and_named_by_devices(capsys):
    from multigpu import __version__
    from multigpu.cli import devices
    from multigpu.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"multigpu {__version__}"
    assert devices.collect()["versions"]["multigpu"] == __version__


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "--devices", "cpu:0", "cpu:1@0.5", "--ratios", "3,1", "train.py", "--devices", "0", "1"],
     ["run", "--devices", "cpu:0,cpu:1@0.5", "--ratios", "3,1", "train.py", "--devices", "0", "1"]),
    (["run", "--gpus", "0,", "1", "train.py"], ["run", "--gpus", "0,1", "train.py"]),
    (["bench", "--devices", "cpu:0,cpu:1", "cpu:2/2GiB", "--batch-size", "8"],
     ["bench", "--devices", "cpu:0,cpu:1,cpu:2/2GiB", "--batch-size", "8"]),
    (["calibrate", "--devices", "auto", "--model", "mlp"], ["calibrate", "--devices", "auto", "--model", "mlp"]),
])
def test_every_command_takes_devices_with_commas_or_spaces_and_leaves_the_scripts_arguments(argv, expected):
    from multigpu.cli.main import join_device_lists

    assert join_device_lists(argv) == expected


def test_bench_counts_the_devices_not_the_arguments():
    from multigpu.cli import bench
    from multigpu.cli.main import build_parser, join_device_lists
    from multigpu.devices import parse_devices

    auto = len(parse_devices("auto", num_gpus=0))
    for argv, count in ((["bench", "--batch-size", "256"], auto), (["bench", "--devices", "cpu:0", "cpu:1"], 2),
                        (["bench", "--devices", "cpu:0,cpu:1,cpu:2"], 3)):
        args = build_parser().parse_args(join_device_lists(argv))
        assert bench._count(args) == count, argv
    args = build_parser().parse_args(["bench", "--devices", "cpu:0,cpu:1", "--ratios", "3,1", "--batch-size", "256"])
    bench._check(args)  # two ratios for two devices given in one argument: accepted


@pytest.mark.parametrize("argv", [["run", "--nope", "x.py"], ["bench", "--steps", "many"], ["devices", "extra"],
                                  ["launch"]])
def test_a_misused_command_line_exits_2_with_one_line(argv, capsys):
    from multigpu.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err, err


@pytest.mark.parametrize(("module", "package"), [("jax", "jax"), ("jaxlib", "jax"), ("tensorflow", "tensorflow"),
                                                 ("matplotlib", "matplotlib")])
def test_a_backend_that_is_not_installed_names_the_package_to_install(module, package, capsys, monkeypatch):
    """The hint names the framework's own package, which pip finds on PyPI, in the versions pyproject.toml allows."""
    from multigpu.cli import devices
    from multigpu.cli.main import main

    def missing(args):
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    monkeypatch.setattr(devices, "run", missing)
    assert main(["devices"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install '{package}" in err and "keras-multigpu" not in err, err
    from importlib.metadata import requires

    pinned = [r.split(";")[0].replace(" ", "") for r in requires("keras-multigpu") if r.startswith(package)]
    assert f"pip install '{pinned[0]}'" in err, (pinned, err)  # the range of the extra, e.g. jax<0.11,>=0.5


def test_every_command_says_what_it_does_with_an_example(capsys):
    from multigpu.cli.main import _COMMANDS, main

    for name in _COMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert f"multigpu {name}" in out.split("options:")[0].split("\n", 2)[-1], (name, out)


def test_messages_go_through_the_multigpu_logger_and_its_level_quiets_them(capsys, monkeypatch):
    import logging

    from multigpu import log

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a program that configured no logging (not pytest)
    before = log.logger.level
    try:
        log.logger.info("a notice")
        log.logger.warning("a warning")
        out = capsys.readouterr()
        assert out.out == "multigpu: a notice\n" and out.err == "multigpu: a warning\n"
        log.set_level("warning")
        log.logger.info("hidden")
        log.logger.error("failed", extra={"source": "multigpu run"})
        out = capsys.readouterr()
        assert out.out == "" and out.err == "multigpu run: failed\n"
        with pytest.raises(ValueError, match=r"must be one of debug, info, warning, error\. Received: 'loud'"):
            log.set_level("loud")
        assert logging.getLogger("multigpu").level == logging.WARNING
    finally:
        log.logger.setLevel(before)


def test_a_programs_logging_configuration_receives_multigpus_messages(runner):
    """``logging.basicConfig`` in the user's script: the ranks' messages reach its handler, in its format, once;
    without it they are printed as multigpu writes them."""
    script = runner.tmp_path / "logs.py"
    script.write_text(
        "import logging, os, sys\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='USER %(name)s %(message)s')\n"
        "import keras, numpy as np, multigpu\n"
        "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
        "model = multigpu.parallelize(model, devices=['cpu:0', 'cpu:1'])\n"
        "model.compile('sgd', 'mse')\n"
        "model.fit(np.ones((32, 3), 'float32'), np.ones((32, 1), 'float32'), batch_size=16, verbose=0)\n")
    run = [sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1", str(script)]
    configured, plain = runner.together(  # at once, each with a profile of its own
        ([*run, "configured"], {"MULTIGPU_PROFILE": str(runner.tmp_path / "configured.json")}),
        ([*run, "plain"], {"MULTIGPU_PROFILE": str(runner.tmp_path / "plain.json")}), timeout=150)
    assert configured.returncode == 0 and plain.returncode == 0, configured.stdout[-2000:] + plain.stdout[-2000:]
    line = "2 devices (CPU:0, CPU:1), shares 50%/50% (8 + 8 rows of each batch of 16)"
    assert configured.stdout.count(f"USER multigpu {line}") == 1, configured.stdout[-2000:]
    assert f"multigpu: {line}" not in configured.stdout, configured.stdout[-2000:]
    assert plain.stdout.count(f"multigpu: {line}") == 1 and "USER" not in plain.stdout, plain.stdout[-2000:]
    assert runner.leftovers() == []


def test_run_log_level_reaches_the_ranks_through_the_environment(monkeypatch, tmp_path):
    import os

    from multigpu import env, log
    from multigpu.cli import run
    from multigpu.cli.main import main

    seen = {}

    class StopError(Exception):
        pass

    def detect(environ):
        seen["level"] = environ.get(env.LOG_LEVEL)
        raise StopError

    monkeypatch.setattr(run.environments, "detect", detect)
    saved, level = os.environ.pop(env.LOG_LEVEL, None), log.logger.level
    script = tmp_path / "train.py"
    script.write_text("")
    try:
        with pytest.raises(StopError):
            main(["run", "--log-level", "error", "--devices", "cpu:0", "cpu:1", str(script)])
        assert seen["level"] == "error" and log.logger.level == 40
    finally:  # neither the level nor the variable may reach the tests after this one
        log.logger.setLevel(level)
        os.environ.pop(env.LOG_LEVEL, None)
        if saved is not None:
            os.environ[env.LOG_LEVEL] = saved


def test_plan_prints_what_each_device_holds_at_each_level_and_the_largest_model(capsys, tmp_path):
    """24 and 12 GiB, 1.2B weights with AdamW: the state in parts by memory (2:1); whole, each device holds 16
    bytes a weight (17.88 GiB: not on 12 GiB); the largest model whole is what 12 GiB holds at 16 bytes a
    weight, at shard='gradients' what 24 GiB holds at 4 + 8 x 2/3 bytes (1.93B weights)."""
    from multigpu.cli.main import main

    assert main(["plan", "--memory", "24GiB,12GiB", "--weights", "1.2e9", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "1,200,000,000 trainable weights (float32, 4.47 GiB), AdamW: 2 values a weight" in out
    assert "each device's part of the state: 67%, 33%" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("shard", "level"))}
    assert rows["shard_optimizer=False"] == ["17.88", "GiB", "17.88", "GiB", "no"]
    assert rows["shard='optimizer'"] == ["14.90", "GiB", "11.92", "GiB", "yes"]
    assert rows["shard='gradients'"] == ["10.43", "GiB", "7.45", "GiB", "yes"]
    assert rows["shard='weights'"] == ["8.94", "GiB", "4.47", "GiB", "yes"]  # 12 bytes a weight of its part
    assert f"The largest model at shard_optimizer=False: {12 * 2**30 // 16:,} trainable weights." in out
    assert f"The largest model at shard='gradients': {int(12 * 2**30 // (4 + 8 / 3)):,} trainable" in out

    import keras  # a saved model: its weights and its compiled optimizer (SGD with momentum: 1 value a weight)

    model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(1000), keras.layers.BatchNormalization()])
    model.compile(keras.optimizers.SGD(momentum=0.9), "mse")
    model.save(tmp_path / "m.keras")
    assert main(["plan", "--devices", "cpu:0/1MiB", "cpu:1", "--model", str(tmp_path / "m.keras")]) == 0
    out = capsys.readouterr().out
    assert "103,000 trainable weights (float32, 0.4 MiB)" in out, out  # Dense 100 x 1000 + 1000, BN's 2 x 1000
    assert "SGD: 1 values a weight" in out and "CPU:1 (memory unknown)" in out
    assert "The largest model at shard_optimizer=False: " in out  # CPU:0 alone bounds it


@pytest.mark.parametrize(("argv", "message"), [
    (["--memory", "24GiB", "--weights", "1e9"], "plan takes two devices or more"),
    (["--memory", "24GiB,12GiB", "--weights", "lots"], "--weights takes a positive count, e.g. 1.2e9, 350M or 7B. "
                                                       "Received: 'lots'"),
    (["--memory", "24GiB,12GiB", "--weights", "1e9", "--optimizer", "nope"], "--optimizer takes a Keras "
                                                                              "optimizer's name"),
    (["--devices", "cpu:0", "cpu:1", "--memory", "1GiB", "--weights", "1e9"], "--memory takes one size per device"),
])
def test_plan_refuses_bad_input_saying_what_it_received(argv, message, capsys):
    from multigpu.cli.main import main

    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_run_in_turn_takes_one_process_configurations_only():
    from multigpu.bench.runs import run_in_turn

    for mode in ("multigpu", "tf-mirrored"):  # several processes; a baseline's process
        with pytest.raises(ValueError, match=rf"one process each of multigpu's own \(single, solo, calibrate\)\. "
                                             rf"Received: mode '{mode}'"):
            run_in_turn([{"mode": "calibrate", "devices": ["cpu:0"]}, {"mode": mode, "devices": ["cpu:0"]}])
