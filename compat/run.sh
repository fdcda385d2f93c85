#!/usr/bin/env bash
# `make compat`: the versions pyproject.toml claims, run. One virtual environment per corner under .compat/,
# each running the exactness suites of both backends and the keras-hub tasks' test; a summary per corner goes to
# compat/RESULTS.md. The middle of the range (the Makefile's pins) is what `make test` runs.
#
#   bash compat/run.sh              # every corner
#   bash compat/run.sh newest       # one corner (the others keep their last row in compat/RESULTS.md)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
TESTS="tests/test_exactness.py tests/test_jax.py tests/test_hub.py tests/test_applications.py"

# corner name, then what pip installs before the project (the project's own requirements are then satisfied).
# The tf- corners are the TensorFlow backend's: the lowest TensorFlow claimed (2.16, the first whose tf.keras is
# Keras 3) with the lowest Keras, and the newest TensorFlow with keras-nightly; torch's CPU wheel beside it (the
# engine that sums TensorFlow's gradients; the only CPU wheel the index here serves is the Makefile's 2.13.0).
declare -A CORNERS=(
  [tf-lowest]='tensorflow-cpu==2.16.2 keras==3.10.0 torch==2.13.0+cpu'
  [tf-newest]='tensorflow-cpu==2.21.0 torch==2.13.0+cpu'
  # The lowest versions claimed (jax 0.5: before it, a callback inside a custom_vjp's forward rule could not be
  # differentiated, which sync_batchnorm on JAX does). keras-hub needs Keras 3.15 or newer, so its test is skipped here (and says so).
  [lowest]='torch==2.4.1 keras==3.10.0 jax[cpu]==0.5.0'
  # The newest that install here: Keras's and keras-hub's nightly builds, torch 2.14.1 and jax 0.10.2 (jax 0.11
  # and newer need Python 3.12, which this machine's Debian 12 does not have).
  [newest]='torch==2.14.1 jax[cpu]==0.10.2'
)
# Installed over the project's own `keras` requirement (keras-nightly and keras share the `keras` folder, and pip
# does not count one for the other), and keras-hub without TensorFlow, as the Makefile does.
declare -A KERAS=([lowest]='' [newest]='keras-nightly' [tf-lowest]='' [tf-newest]='keras-nightly')
declare -A HUB=([lowest]='' [newest]='keras-hub-nightly' [tf-lowest]='' [tf-newest]='')
# What each corner runs: the exactness suites of torch and JAX, or the TensorFlow backend's.
declare -A TESTS_OF=([lowest]="$TESTS" [newest]="$TESTS" [tf-lowest]="tests/test_tensorflow.py"
                     [tf-newest]="tests/test_tensorflow.py")

corner() {
  local name=$1 venv=.compat/$1
  if [ ! -f "$venv/.installed" ]; then
    rm -rf "$venv" && $PYTHON -m venv "$venv" || return 1
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --quiet ${CORNERS[$name]} || return 1
    "$venv/bin/pip" install --quiet -e ".[test]" || return 1
    if [ -n "${KERAS[$name]}" ]; then
      "$venv/bin/pip" uninstall --quiet -y keras || return 1
      "$venv/bin/pip" install --quiet --force-reinstall --no-deps --pre "${KERAS[$name]}" || return 1
    fi
    if [ -n "${HUB[$name]}" ]; then
      "$venv/bin/pip" install --quiet --no-deps --pre "${HUB[$name]}" || return 1
      "$venv/bin/pip" install --quiet absl-py regex rich tokenizers sentencepiece kagglehub grain || return 1
    fi
    touch "$venv/.installed"
  fi
  local versions
  versions=$(KERAS_BACKEND=torch TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "
import importlib
found = []
for name, label in [('keras', 'keras'), ('tensorflow', 'tensorflow'), ('torch', 'torch'), ('jax', 'jax'),
                    ('keras_hub', 'keras-hub')]:
    try:
        found.append(f'{label} {importlib.import_module(name).__version__}')
    except ImportError:
        found.append(f'{label} not installed')
print(', '.join(found))" 2>/dev/null)
  echo "== $name: $versions"
  local start=$SECONDS
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 KERAS_BACKEND=torch "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs ${TESTS_OF[$name]} \
    > "$venv/pytest.log" 2>&1
  local code=$?
  local summary
  summary=$(tail -1 "$venv/pytest.log")
  echo "   $summary ($((SECONDS - start)) s)"
  echo "| $name | $versions | $summary | $(date -u +%Y-%m-%d), $(git rev-parse --short HEAD) |" >> compat/RESULTS.md.new
  return $code
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(lowest newest tf-lowest tf-newest)
: > compat/RESULTS.md.new
failed=0
for n in "${names[@]}"; do
  [ -n "${CORNERS[$n]+x}" ] || { echo "unknown corner $n; allowed: ${!CORNERS[*]}"; exit 2; }
  corner "$n" || failed=1
done
{
  echo "# make compat"
  echo
  echo "Command: \`make compat\` (\`bash compat/run.sh\`). Tests: \`$TESTS\` (the tf- corners:"
  echo "\`tests/test_tensorflow.py\`)."
  echo
  echo "| corner | versions | pytest | date, commit |"
  echo "|---|---|---|---|"
  # Corners not run this time keep their last row.
  for n in lowest newest tf-lowest tf-newest; do
    if grep -q "^| $n |" compat/RESULTS.md.new; then grep "^| $n |" compat/RESULTS.md.new
    else grep "^| $n |" compat/RESULTS.md 2>/dev/null || true; fi
  done
} > compat/RESULTS.md.all
mv compat/RESULTS.md.all compat/RESULTS.md
rm -f compat/RESULTS.md.new
exit $failed
