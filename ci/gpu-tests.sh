#!/usr/bin/env bash
# Build moe_kernels for this machine's GPU, run the whole test suite and a short benchmark.
# For any GPU machine (developer box, GPU CI runner). Needs: CUDA toolkit, a CUDA build of
# PyTorch, cmake, ninja, pybind11, scikit-build-core and nvidia-cutlass installed, or their
# wheels in .whl/ (installed offline from there). Builds without isolation, all cores.
#
#   ci/gpu-tests.sh                      # full catalog, tests, default benchmark
#   MOE_KERNELS_CATALOG=minimal BENCH_ARGS="--tokens 1,128" LOG_DIR=/tmp/logs ci/gpu-tests.sh
#   SKIP_BUILD=1 ci/gpu-tests.sh         # reuse the installed build
#   WHEEL=dist/moe_kernels_cu13-*.whl ci/gpu-tests.sh   # install a built wheel (ci/build-wheel.sh) instead
#   SKIP_BENCH=1 PYTEST_ARGS="-k 'contig or fp8_block'" ci/gpu-tests.sh   # a subset, no benchmark
#
# Logs (build.log, tests.log, junit.xml, errors.json, bench.json, bench.log, sass.txt) go to LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-build/gpu-logs}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1

MOE_KERNELS_ARCHS=${MOE_KERNELS_ARCHS:-$(ci/gpu-arch.sh)}
export MOE_KERNELS_ARCHS MOE_KERNELS_CATALOG=${MOE_KERNELS_CATALOG:-full}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$LOG_DIR/gpu.txt"

if [ -n "${WHEEL:-}" ]; then
  echo "== install $WHEEL"
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --no-deps --force-reinstall $WHEEL
elif [ -z "${SKIP_BUILD:-}" ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps .whl/*.whl
  fi
  echo "== build: archs=$MOE_KERNELS_ARCHS catalog=$MOE_KERNELS_CATALOG jobs=$CMAKE_BUILD_PARALLEL_LEVEL"
  start=$(date +%s)
  if ! $PY -m pip install --no-build-isolation --no-deps -v . > "$LOG_DIR/build.log" 2>&1; then
    grep -E "error|FAILED" "$LOG_DIR/build.log" | head -40
    tail -n 30 "$LOG_DIR/build.log"
    exit 1
  fi
  echo "build took $(( $(date +%s) - start )) s"
fi
pkg=$($PY -c "import moe_kernels, os; print(os.path.dirname(moe_kernels.__file__))")
ls -l "$pkg"/libmoe_kernels_*.so
for lib in "$pkg"/libmoe_kernels_*.so; do
  sass=$(cuobjdump --dump-sass "$lib")
  echo "$(basename "$lib"): $(grep -c HGMMA <<< "$sass") HGMMA (16-bit), $(grep -c QGMMA <<< "$sass") QGMMA (fp8)," \
    "$(grep -c 'HMMA\.16816' <<< "$sass") HMMA (mma.sync: decode kernels) instructions" | tee -a "$LOG_DIR/sass.txt"
done
$PY -m moe_kernels info

echo "== tests"
status=0
eval "pytest_args=(${PYTEST_ARGS:-})"  # keeps quoted words whole: PYTEST_ARGS="-k 'contig or fp8'"
MOE_KERNELS_ERROR_REPORT="$LOG_DIR/errors.json" $PY -m pytest tests -q -rs --durations=10 \
  --junitxml="$LOG_DIR/junit.xml" "${pytest_args[@]}" 2>&1 | tee "$LOG_DIR/tests.log" || status=$?
[ -f "$LOG_DIR/errors.json" ] && cat "$LOG_DIR/errors.json"

if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== benchmark"
  # shellcheck disable=SC2086
  $PY -m moe_kernels bench --json "$LOG_DIR/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench.log" || status=1
fi
exit $status
