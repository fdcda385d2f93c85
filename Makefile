# Set-up and the two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-tf
# The torch to install first (a pip requirement and its options): a GPU machine names its CUDA build, e.g.
# make demo TORCH="torch --index-url https://download.pytorch.org/whl/cu126"
TORCH ?= torch==2.13.0
# `make demo` runs on the caller's KERAS_BACKEND (torch when unset); every other target sets its own.
DEMO_BACKEND := $(or $(KERAS_BACKEND),torch)
export KERAS_BACKEND := torch

.PHONY: demo test docs gpu-check test-examples test-outside test-launchers lint bench compat keras-suite keras-suite-jax keras-suite-tf clean

# Everything after torch installs through uv (one small wheel, installed by pip into .venv): it resolves and
# downloads in parallel and compiles the bytecode as pip does (every process here imports without writing it),
# the same packages at the same versions; the tests' set-up took 30 s with it where pip took 77 s. Where uv
# cannot install (no wheel for the platform, its index unreachable) pip installs the same; `make test UV=` uses
# pip alone. torch stays with pip: TORCH is a pip requirement and its options, and pip's configuration may name
# where the CPU build lies.
UV ?= uv==0.13.8
comma := ,
INSTALL = $(if $(UV),$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(1) || )$(BIN)/pip install --quiet $(1)

# What `make demo` needs, and nothing else: torch's CPU build, multigpu (Keras with it) and matplotlib for the
# chart. The CPU build of torch first: an unpinned `torch` can pull a CUDA build of several GB.
$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(if $(UV),$(BIN)/pip install --quiet "$(UV)" || true)
	$(call INSTALL,-e ".[plot]")
	touch $(DEMO_STAMP)

# What the tests need on top: jax's CPU build for the JAX backend (KERAS_BACKEND=jax), the test tools, the
# documentation site's (make test builds it),
# keras-hub for the tests of its tasks, without TensorFlow: --no-deps leaves out its tensorflow-text
# requirement (used only by its TF tokenizers), and the rest of what it imports comes before it (one install call:
# each call resolves and builds multigpu's editable wheel again).
$(STAMP): $(DEMO_STAMP)
	$(call INSTALL,"jax[cpu]==0.10.2" -e ".[test$(comma)docs]" absl-py regex rich tokenizers sentencepiece kagglehub grain)
	$(call INSTALL,--no-deps "keras-hub==0.32.0")
	# The Jupyter kernel the notebook tests run in, inside .venv (nothing outside it is touched).
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# TensorFlow's CPU build (and TensorBoard, which Keras's TensorBoard callback writes with) for the tf.data tests,
# the TensorFlow backend's tests, the training recipes' TensorBoard logs and the image-folder example only
# (multigpu imports it only when the data is a tf.data.Dataset or KERAS_BACKEND=tensorflow; it leaves Keras as it
# is), so that `make demo` does not wait for it.
$(TEST_STAMP): $(STAMP)
	$(call INSTALL,"tensorflow-cpu==2.21.0" "tensorboard==2.21.0")
	touch $(TEST_STAMP)

demo: $(if $(filter tensorflow,$(DEMO_BACKEND)),$(TEST_STAMP),$(if $(filter jax,$(DEMO_BACKEND)),$(STAMP),$(DEMO_STAMP)))
	@# Fashion-MNIST from Debian's package when we may install it; the demo falls back to synthetic data otherwise.
	@test -d /usr/share/datasets/fashion-mnist || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)); } || true
	KERAS_BACKEND=$(DEMO_BACKEND) $(BIN)/python examples/demo.py $(ARGS)

# The documentation site (docs/, mkdocs.yml) into site/: --strict, so that a broken link or reference fails.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(DEMO_STAMP)
	@# (the tests' set-up installs it too, in its one install call: then nothing more to do)
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || \
		$(BIN)/pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check multigpu tests benchmarks examples keras_suite docs

test: $(TEST_STAMP) lint docs
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 --ignore=tests/test_examples.py \
		-m "not outside"

# Every check that needs a GPU, on a machine with one and a CUDA build of torch (and Keras) in GPU_PYTHON:
# the CUDA path (a GPU rank beside a CPU rank, exact), a real CUDA out-of-memory error taken again within a
# lowered cap, the optimizer state in parts (and shard="gradients") on a GPU rank beside a CPU rank (mixed
# precision among its cases), and the
# TensorFlow and JAX GPU paths where their CUDA builds are installed in GPU_PYTHON (skipped, and said, where
# not). Nothing else depends on a GPU. 3 min 27 s on one H100 for the first 5 tests (0.3.0); the TensorFlow and
# JAX cases and shard="gradients" have not run on a GPU yet. Two GPUs over NCCL need a machine with two.
GPU_PYTHON ?= python3
gpu-check:
	KERAS_BACKEND=torch OMP_NUM_THREADS=1 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -rs -o addopts="" tests/test_cuda.py

# Slow outside checks kept out of `make test`'s 12 minutes (CONTRIBUTING.md gives its figures from fresh 2-core clones
# and says where the time goes): keras-hub's
# tasks on JAX, the CLI's bench with its DDP baselines and its sweep, and the second backend, ratio or mode of a
# few paths (tests/conftest.py's OUTSIDE says which and why).
test-outside: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/test_examples.py -m outside

# The launchers' tests with a real SLURM (one slurmctld and one slurmd on this machine) and Open MPI's mpirun,
# installed first from Debian's packages when run as root (`make test` runs the same file and reports those tests
# as skipped where SLURM or Open MPI is not installed).
test-launchers: $(STAMP)
	@command -v srun >/dev/null && command -v mpirun >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get install -y -qq slurm-wlm openmpi-bin >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq slurm-wlm openmpi-bin >/dev/null 2>&1)); } || true
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/test_launchers.py

# Every example under examples/ end to end with --quick, the notebook in a real kernel on both backends
# (an outside check: 7 min 45 s from a fresh clone on 2026-12-08).
test-examples: $(TEST_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_examples.py

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_core.py

# The versions pyproject.toml claims, run: one virtual environment per corner under .compat/ (lowest: Keras 3.10,
# torch 2.4, jax 0.5; newest: keras-nightly, keras-hub-nightly, torch 2.14, jax 0.10), each running the
# exactness, JAX, keras-hub and keras.applications tests, and two TensorFlow corners (tf-lowest: TensorFlow 2.16,
# Keras 3.10; tf-newest: TensorFlow 2.21, keras-nightly) running the TensorFlow backend's tests; writes
# compat/RESULTS.md (an outside check: about 11 min once the environments exist, plus their installs the first
# time). `bash compat/run.sh tf-lowest` runs one corner.
compat:
	bash compat/run.sh

# Keras's own trainer, callback and saving tests with every model parallelized (an outside check, ~min).
keras-suite: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python keras_suite/run.py --write keras_suite/RESULTS.md

# The same on the JAX backend.
keras-suite-jax: $(STAMP)
	KERAS_BACKEND=jax OMP_NUM_THREADS=1 $(BIN)/python keras_suite/run.py --write keras_suite/RESULTS-jax.md

# The same on the TensorFlow backend.
keras-suite-tf: $(TEST_STAMP)
	KERAS_BACKEND=tensorflow OMP_NUM_THREADS=1 $(BIN)/python keras_suite/run.py --write keras_suite/RESULTS-tf.md

clean:
	rm -rf $(VENV) .compat *.egg-info .pytest_cache .ruff_cache
