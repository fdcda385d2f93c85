"""Keras's own tests with every model parallelized: an outside check of multigpu.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python keras_suite/run.py    # or: make keras-suite
    KERAS_BACKEND=jax ... keras_suite/run.py --write keras_suite/RESULTS-jax.md  # or: make keras-suite-jax
    KERAS_BACKEND=tensorflow ... keras_suite/run.py --write keras_suite/RESULTS-tf.md  # or: make keras-suite-tf
    ... keras_suite/run.py --files trainers/trainer_test.py --write keras_suite/RESULTS.md

Runs test files of the installed Keras (trainers, callbacks and saving by default):

1. **plain**: once in one process, as Keras's CI would (the reference: some tests need
   TensorFlow or other packages, or are skipped on this backend);
2. **parallel**: the tests that pass plainly and compile a ``keras.Model``, with
   ``multigpu run --devices cpu:0,cpu:1``, every rank running the same selection, every
   ``keras.Model`` passed to ``multigpu.parallelize`` when it is compiled (``plugin.py``).
   When a test ends the run (a failure multigpu turns into the end of the run, as it must),
   the run starts again from the next test, and that test counts as failed with the run's
   message.

A test *passes* when it passes on every rank.  It is *not applicable* when it does not pass
in the plain run either (the reason is the plain run's), and *not reached* when it passes
without compiling a ``keras.Model`` (it tests a ``Trainer`` mixed into a layer, or a
callback on its own), so multigpu was not involved.  The table of counts and every
failure or not-applicable test with its reason go to ``--write`` (Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FILES = ["trainers/trainer_test.py", "trainers/epoch_iterator_test.py", "callbacks/*_test.py",
                 "saving/saving_api_test.py", "saving/saving_lib_test.py"]


# Failures that come from running a one-process test on every rank, not from multigpu, each with why.
# They still run and still count as failed; the report prints the reason beside them.
_DELETES = ("deletes the files it checks on every rank (`os.remove`); in the folder the ranks share, the "
            "other rank finds them gone. A script on several ranks deletes a shared file on one rank.")
_INTERNAL = ("calls Keras's internal `saving_lib` on every rank, so every rank writes the same file at once. "
             "`model.save`, `save_weights` and `keras.saving.save_model` write once, on rank 0.")
_UNSEEDED = ("draws its data with NumPy's unseeded global generator, so each rank has different values; "
             "multigpu requires the same data on every rank (it checks lengths, not values).")
_CORRUPTS = ("writes over the backup file on every rank (to corrupt it); in the folder the ranks share, one "
             "rank's write can land after the other rank's next backup, or while it reads one (it fails now and "
             "then, on either backend). A script on several ranks writes a shared file on every rank.")
_EAGER = ("counts how often Keras traces the model's own `train_step` and allows 2; on JAX multigpu runs a "
          "`train_step` of the model's own eagerly, once a step (README, \"On JAX\"), so it counts one a batch. "
          "A limitation of multigpu on JAX.")
_RAGGED = ("passes a `tf.RaggedTensor` as `x` (TensorFlow only). multigpu refuses it at `fit` on every rank with an "
           "error naming the input forms it takes: a ragged batch's rows cannot be cut into shares as arrays are. "
           "A limitation of multigpu on TensorFlow; pad the rows, or batch them in a `tf.data.Dataset` with "
           "`padded_batch`.")
EXPLAINED = {
    "trainers/trainer_test.py::TestTrainer::test_trainer_with_raggeds_functional": _RAGGED,
    "trainers/trainer_test.py::TestTrainer::test_trainer_with_raggeds_layer": _RAGGED,
    "trainers/trainer_test.py::TestTrainer::test_trainer_with_raggeds_model": _RAGGED,
    "callbacks/backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_backup_corrupted": _CORRUPTS,
    "trainers/trainer_test.py::TestTrainer::test_retracing": _EAGER,
    "callbacks/csv_logger_test.py::CSVLoggerTest::test_CSVLogger": _DELETES,
    "callbacks/model_checkpoint_test.py::ModelCheckpointTest::test_model_checkpoint_options": _DELETES,
    "callbacks/model_checkpoint_test.py::ModelCheckpointTest::test_model_checkpoint_loading": _DELETES,
    "saving/saving_lib_test.py::SavingTest::test_compile_arg": _INTERNAL,
    "saving/saving_lib_test.py::SavingTest::test_load_weights_only_with_keras_file": _INTERNAL,
    "saving/saving_lib_test.py::SavingTest::test_load_weights_only_with_unbuilt_model": _INTERNAL,
    "saving/saving_lib_test.py::SavingTest::test_save_load_weights_only": _INTERNAL,
    "saving/saving_lib_test.py::SavingTest::test_save_weights_subclassed_functional": _INTERNAL,
    "saving/saving_lib_test.py::SavingTest::test_saving_custom_assets_and_variables": _UNSEEDED,
    "saving/saving_lib_test.py::SavingAPITest::test_model_api_endpoint": _UNSEEDED,
}


def keras_src() -> Path:
    out = subprocess.run([sys.executable, "-c", "import keras, os; print(os.path.dirname(keras.__file__))"],
                         capture_output=True, text=True, check=True, env=child_env())
    return Path(out.stdout.strip()) / "src"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIGPU_")}
    env.update(KERAS_BACKEND=env.get("KERAS_BACKEND", "torch"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(HERE), **extra)
    return env


def read_progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plain_run(files: list[str], out: Path) -> list[dict]:
    """Every test of ``files`` in one plain process; outcomes in order."""
    code = ("import sys, pytest; from pathlib import Path; from plugin import Recorder; "
            "r = Recorder(Path(sys.argv[1]), None, None, 0); r.install(); "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-o', 'addopts=', '-W', 'ignore', "
            "'--continue-on-collection-errors', '--basetemp', sys.argv[2], *sys.argv[3:]], plugins=[r]))")
    subprocess.run([sys.executable, "-c", code, str(out / "plain.jsonl"), str(out / "tmp-plain"), *files],
                   env=child_env(), stdout=subprocess.DEVNULL, check=False)
    return read_progress(out / "plain.jsonl")


def parallel_runs(tests: list[str], out: Path, devices: str, timeout: float, log) -> dict[str, dict]:
    """Runs ``tests`` on ``devices``, starting again after a test that ends the run."""
    results: dict[str, dict] = {}
    remaining = list(tests)
    attempt = 0
    while remaining:
        attempt += 1
        folder = out / f"run{attempt}"
        folder.mkdir()
        (folder / "tests.txt").write_text("\n".join(remaining))
        log(f"parallel run {attempt}: {len(remaining)} tests")
        proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "--devices", devices, "--timeout",
                               str(timeout), str(HERE / "rank.py"), str(folder), str(folder / "tests.txt")],
                              env=child_env(KERAS_SUITE_DEVICES=devices, KERAS_SUITE_TIMEOUT=str(timeout)),
                              capture_output=True, text=True, check=False)
        ranks = [{r["id"]: r for r in read_progress(folder / f"rank{i}.jsonl")}
                 for i in range(len(devices.split(",")))]
        finished = 0
        for test in remaining:
            outcomes = [rank.get(test) for rank in ranks]
            if any(o is None for o in outcomes):
                break
            failed = [(i, o) for i, o in enumerate(outcomes) if o["outcome"] == "failed"]
            skipped = [o for o in outcomes if o["outcome"] == "skipped"]
            if failed:
                i, o = failed[0]
                result = {"outcome": "failed", "reason": f"rank {i}: {o['reason']}"}
            elif skipped:
                result = {"outcome": "skipped", "reason": skipped[0]["reason"]}
            else:
                result = {"outcome": "passed", "reason": ""}
            results[test] = {**result, "reached": any(o["reached"] for o in outcomes)}
            finished += 1
        remaining = remaining[finished:]
        if (folder / "resync").exists():  # a test failed on some rank: start again at the next test
            failed_test = (folder / "resync").read_text()
            if remaining and remaining[0] == failed_test:  # another rank never finished it: it failed all the same
                reasons = [f"rank {i}: {rank[failed_test]['reason']}" for i, rank in enumerate(ranks)
                           if failed_test in rank and rank[failed_test]["outcome"] == "failed"]
                results[failed_test] = {"outcome": "failed", "reached": True, "reason": (
                    f"{reasons[0] if reasons else 'failed on a rank'}; another rank did not finish the test")}
                remaining = remaining[1:]
            log(f"  starting again after {failed_test.split('::')[-1]} (failed on a rank)")
            continue
        if remaining and proc.returncode == 0:
            raise RuntimeError(f"run {attempt} ended well but left {len(remaining)} tests undone:\n"
                               f"{proc.stdout[-3000:]}")
        if remaining:  # the test in progress ended the run
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "multigpu" in ln and "rank" in ln]
            # pytest's progress characters share the line with the supervisor's message
            reason = lines[-1].lstrip(".FsExX") if lines else f"the run ended with exit code {proc.returncode}"
            results[remaining[0]] = {"outcome": "ended the run", "reason": reason[:300], "reached": True}
            log(f"  {remaining[0]} ended the run: {reason[:200]}")
            remaining = remaining[1:]
    return results


def classify(plain: dict[str, dict], parallel: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(test, class, reason) for every test, in order."""
    rows = []
    for test, ref in plain.items():
        got = parallel.get(test)
        if ref["outcome"] != "passed":
            rows.append((test, "not applicable", f"plain run {ref['outcome']}: {ref['reason']}"))
        elif got is None:
            rows.append((test, "not reached", ""))
        elif got["outcome"] == "passed":
            rows.append((test, "passed" if got["reached"] else "not reached", ""))
        else:
            rows.append((test, "failed", f"{got['outcome']}: {got['reason']}"))
    return rows


def markdown(rows: list[tuple[str, str, str]], command: str, seconds: float, devices: str) -> str:
    counts = Counter(c for _, c, _ in rows)
    by_file = Counter((t.split("::")[0].split("keras/src/")[-1], c) for t, c, _ in rows)
    files = sorted({f for f, _ in by_file})
    classes = ["passed", "failed", "not reached", "not applicable"]
    out = [
        "# Keras's own tests with every model parallelized",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min). Devices: `{devices}`, "
        f"{child_env()['KERAS_BACKEND']} backend, "
        "every `keras.Model` passed to `multigpu.parallelize` when compiled.",
        "",
        "*passed*: passes on every rank and trained through multigpu; *not reached*: passes, but "
        "compiles no `keras.Model` (a `Trainer` mixed into a layer, a callback alone), so multigpu "
        "is not involved; *not applicable*: does not pass in a plain one-process run either.",
        "",
        "| file | " + " | ".join(classes) + " |",
        "|---|" + "---:|" * len(classes),
    ]
    for f in files:
        out.append(f"| `{f}` | " + " | ".join(str(by_file[(f, c)]) for c in classes) + " |")
    out.append("| **all** | " + " | ".join(f"**{counts[c]}**" for c in classes) + " |")
    failed = [(t, r) for t, c, r in rows if c == "failed"]
    if failed:
        out += ["", f"## Failed ({len(failed)})", ""]
        for t, r in failed:
            name = t.split("keras/src/")[-1]
            why = f" — **why**: {EXPLAINED[name]}" if name in EXPLAINED else " — **not explained**"
            out.append(f"- `{name}`: {r.replace('|', '/')}{why}")
    reasons = Counter(r for _, c, r in rows if c == "not applicable")
    if reasons:
        out += ["", f"## Not applicable ({sum(reasons.values())}), by the plain run's reason", "",
                "| tests | reason |", "|---:|---|"]
        out += [f"| {n} | {r.replace('|', '/')} |" for r, n in reasons.most_common()]
    passed = [t for t, c, _ in rows if c == "passed"]
    if passed:
        out += ["", f"## Passed through multigpu ({len(passed)})", ""]
        out += [f"- `{t.split('keras/src/')[-1]}`" for t in passed]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files under keras/src (globs allowed)")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    p.add_argument("--timeout", type=float, default=20.0, help="multigpu's collective timeout")
    p.add_argument("--write", default=None, help="write the Markdown report here")
    p.add_argument("--plain-results", default=None,
                   help="JSON lines of an earlier plain run to reuse (written there when missing)")
    a = p.parse_args()
    start = time.monotonic()
    src = keras_src()
    files = sorted({str(f) for pattern in a.files for f in src.glob(pattern)})
    if not files:
        p.error(f"no test file matches {a.files} under {src}")

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:6.0f} s] {message}", flush=True)

    with tempfile.TemporaryDirectory(prefix="keras-suite-") as tmp:
        out = Path(tmp)
        log(f"plain run of {len(files)} files")
        saved = Path(a.plain_results) if a.plain_results else None
        if saved is not None and saved.exists():
            plain = {r["id"]: r for r in read_progress(saved)}
        else:
            plain = {r["id"]: r for r in plain_run(files, out)}
            if saved is not None:
                saved.write_text("".join(json.dumps(r) + "\n" for r in plain.values()))
        log(f"plain: {dict(Counter(r['outcome'] for r in plain.values()))}")
        # Only tests that pass plainly and compile a keras.Model involve multigpu; the others are classified
        # from the plain run alone (that halves the suite's time).
        involved = [t for t, r in plain.items() if r["outcome"] == "passed" and r["reached"]]
        parallel = parallel_runs(involved, out, a.devices, a.timeout, log)
    rows = classify(plain, parallel)
    suite = "make keras-suite" + {"jax": "-jax", "tensorflow": "-tf"}.get(child_env()["KERAS_BACKEND"], "")
    command = suite if a.write else " ".join(["keras_suite/run.py", *sys.argv[1:]])
    report = markdown(rows, command, time.monotonic() - start, a.devices)
    print(report)
    if a.write:
        Path(a.write).write_text(report)
    unexplained = [t for t, c, _ in rows if c == "failed" and t.split("keras/src/")[-1] not in EXPLAINED]
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
