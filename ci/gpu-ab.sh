#!/usr/bin/env bash
# A/B timing of a change on one GPU in one go: B is this tree, A is this tree with AB_PATCH
# reversed (a `git diff` from A to B). Both are built (B first; with PYTEST_ARGS, those tests
# run on B and a failure stops the script), then each benchmark runs ROUNDS times per build,
# B and A alternating, so that clock drift and the machine hit both alike: compare kernels on
# one machine, not across machines (they differ by up to 10% on the same code).
#
#   git diff main > .whl/ab.patch       # an ignored folder that travels when carried
#   AB_PATCH=.whl/ab.patch PYTEST_ARGS="tests/test_gpu.py -k 'contig or fp8_block'" ci/gpu-ab.sh \
#       "--preset deepseek-v3 --quant fp8_block --tokens 4096" \
#       "--preset deepseek-v3 --quant fp8_block --tokens 16384 --breakdown"
#
# Each argument is a set of `moe_kernels bench` options (--no-peers is added). A patch that
# touches only python/moe_kernels/*.py needs one build: A is B's package with it reversed.
# For a change a patch cannot undo (renamed or new files), give A's whole tree instead:
#   git archive --format=tar.gz -o .whl/base.tar.gz <commit>; AB_BASE=.whl/base.tar.gz ci/gpu-ab.sh ...
# AB_REUSE_B=1 takes B from $AB_WORK/B as an earlier run on this machine left it (no build).
# Builds as ci/gpu-tests.sh does (MOE_KERNELS_ARCHS, default this GPU's; MOE_KERNELS_CATALOG,
# default minimal; wheels in .whl/), without isolation. The tree is left as it came. Logs and one
# JSON per run go to LOG_DIR; the table rows are printed as they come.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=$(realpath -m "${LOG_DIR:-build/ab-logs}")
ROUNDS=${ROUNDS:-2}
WORK=${AB_WORK:-/tmp/moe-kernels-ab}
if { [ ! -f "${AB_PATCH:-}" ] && [ ! -f "${AB_BASE:-}" ]; } || [ $# -eq 0 ]; then
  echo "usage: AB_PATCH=<diff from A to B> | AB_BASE=<A's tree, .tar.gz> [AB_REUSE_B=1] [PYTEST_ARGS=...]" \
       "[ROUNDS=2] ci/gpu-ab.sh '<bench options>' ..." >&2
  exit 2
fi
mkdir -p "$LOG_DIR" "$WORK"
export PYTHONUNBUFFERED=1
MOE_KERNELS_ARCHS=${MOE_KERNELS_ARCHS:-$(ci/gpu-arch.sh)}
export MOE_KERNELS_ARCHS MOE_KERNELS_CATALOG=${MOE_KERNELS_CATALOG:-minimal}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps .whl/*.whl
fi

build() {  # build this tree as variant $1 and keep a copy of the installed package
  local start=$SECONDS
  if ! $PY -m pip install --no-build-isolation --no-deps -v . > "$LOG_DIR/build-$1.log" 2>&1; then
    grep -E "error|FAILED" "$LOG_DIR/build-$1.log" | head -40
    exit 1
  fi
  local pkg
  pkg=$(cd / && $PY -c "import moe_kernels, os; print(os.path.dirname(moe_kernels.__file__))")
  rm -rf "${WORK:?}/$1" && mkdir -p "$WORK/$1" && cp -r "$pkg" "$WORK/$1/"
  echo "== built $1 in $((SECONDS - start)) s"
}

if [ -n "${AB_REUSE_B:-}" ] && [ -d "$WORK/B/moe_kernels" ]; then
  echo "== B: the build already in $WORK/B"
else
  build B
fi
if [ -n "${PYTEST_ARGS:-}" ]; then
  eval "pytest_args=($PYTEST_ARGS)"  # keeps quoted words whole: -k "contig or fp8_block"
  if ! PYTHONPATH="$WORK/B" $PY -m pytest -q -rs "${pytest_args[@]}" > "$LOG_DIR/tests-B.log" 2>&1; then
    grep -E "^(FAILED|ERROR)|Error" "$LOG_DIR/tests-B.log" | head -20
    tail -n 3 "$LOG_DIR/tests-B.log"
    echo "tests failed on B: no timings" >&2
    exit 1
  fi
  tail -n 1 "$LOG_DIR/tests-B.log"
fi
if [ -n "${AB_BASE:-}" ]; then  # A's own tree, built where it was unpacked
  rm -rf "${WORK:?}/src-A" && mkdir -p "$WORK/src-A" && tar xzf "$AB_BASE" -C "$WORK/src-A"
  (cd "$WORK/src-A" && build A)
elif grep '^diff --git' "$AB_PATCH" | grep -qv ' a/python/moe_kernels/[^ ]*\.py '; then
  patch -s -R -p1 < "$AB_PATCH"
  trap 'patch -s -p1 < "$AB_PATCH"' EXIT  # back to B's tree
  build A
else  # Python only: A is B's build with its package's files patched back (no second build)
  rm -rf "${WORK:?}/A" && cp -r "$WORK/B" "$WORK/A"
  patch -s -R -p2 -d "$WORK/A" < "$AB_PATCH"
  echo "== A: B's build with the Python patch reversed"
fi

status=0
run=0
for args in "$@"; do
  for round in $(seq "$ROUNDS"); do
    for v in B A; do
      run=$((run + 1))
      log="$LOG_DIR/run$run-$v"
      # shellcheck disable=SC2086
      if ! PYTHONPATH="$WORK/$v" $PY -m moe_kernels bench --no-peers $args --json "$log.json" > "$log.log" 2>&1; then
        status=1
      fi
      echo "== $v, round $round: $args"
      grep -E "^[a-z0-9.-]+ +[0-9]+ |ran at|steps|wrong|rror" "$log.log" || tail -n 3 "$log.log"
    done
  done
done
exit $status
