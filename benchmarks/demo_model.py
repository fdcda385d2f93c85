"""The network of ``make demo`` (``examples/demo.py``'s ``build_model`` at width 1), for the benchmarks.

    ... benchmarks/bench_demo.py --model benchmarks/demo_model.py:build --batches 128 256 512
"""

import importlib.util
from pathlib import Path

_DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def build():
    spec = importlib.util.spec_from_file_location("multigpu_demo_example", _DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model(1.0)
