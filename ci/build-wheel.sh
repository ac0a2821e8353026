#!/usr/bin/env bash
# The release wheel for one CUDA major: moe-kernels-cu13 (MOE_KERNELS_CUDA=13, the default) or
# moe-kernels-cu12 (12), with every arch the catalog builds (90a, 100a, 103a), the full catalog
# and no -lineinfo. The nvcc on the PATH (or CUDACXX) must be of that CUDA major: CMake checks.
#
#   ci/build-wheel.sh                                                   # dist/moe_kernels_cu13-*.whl
#   MOE_KERNELS_CUDA=12 CUDACXX=/usr/local/cuda-12.9/bin/nvcc ci/build-wheel.sh
#   MOE_KERNELS_ARCHS=90a MOE_KERNELS_CATALOG=minimal ci/build-wheel.sh  # a quick check of this script
#   PYTHONS="python3.11 python3.12" ci/build-wheel.sh                  # one wheel per interpreter
#
# The first interpreter's wheel builds everything; the per-arch libraries do not depend on the
# Python version, so they are taken from it (MOE_KERNELS_PREBUILT_DIR) for the others, which
# compile only the small Python module. Built with build isolation: the CUDA 13 toolkit comes
# from pyproject.toml's build requirements (cmake/cuda_from_pypi.cmake) unless CUDACXX is set;
# a cu12 build needs CUDACXX (PyPI has no CUDA 12 nvcc), and drops the CUDA 13 requirements.
#
# A PEP 621 name is static, so a cu12 build renames the distribution in a copy of the tree.
# A wheel over MAX_WHEEL_MB (PyPI's default limit, 100) fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."
export MOE_KERNELS_CUDA=${MOE_KERNELS_CUDA:-13}
export MOE_KERNELS_ARCHS=${MOE_KERNELS_ARCHS:-"90a;100a;103a"}
export MOE_KERNELS_CATALOG=${MOE_KERNELS_CATALOG:-full}
export MOE_KERNELS_LINEINFO=${MOE_KERNELS_LINEINFO:-OFF}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
DIST=$(realpath -m "${DIST_DIR:-dist}")
PYTHONS=${PYTHONS:-${PYTHON:-python3}}
name="moe-kernels-cu$MOE_KERNELS_CUDA"
src=.
if [ "$MOE_KERNELS_CUDA" != 13 ]; then
  src=$(mktemp -d)/moe-kernels
  mkdir -p "$src"
  git ls-files -z | xargs -0 cp --parents -t "$src"
  sed -i "s/^name = \"moe-kernels-cu13\"/name = \"$name\"/" "$src/pyproject.toml"
  grep -q "^name = \"$name\"" "$src/pyproject.toml" || { echo "pyproject.toml: no name to rename" >&2; exit 1; }
  sed -i '/^  "cuda-toolkit\[/d; /^  "nvidia-cuda-\|^  "nvidia-nvvm/d' "$src/pyproject.toml"
  [ -n "${CUDACXX:-}" ] || { echo "MOE_KERNELS_CUDA=$MOE_KERNELS_CUDA: set CUDACXX to a CUDA $MOE_KERNELS_CUDA nvcc" >&2; exit 1; }
fi
echo "== $name: archs=$MOE_KERNELS_ARCHS catalog=$MOE_KERNELS_CATALOG lineinfo=$MOE_KERNELS_LINEINFO"
libs=""
for py in $PYTHONS; do
  start=$SECONDS
  MOE_KERNELS_PREBUILT_DIR=$libs $py -m pip wheel --no-deps -w "$DIST" "$src"
  wheel=$(ls -t "$DIST"/"${name//-/_}"-*.whl | head -n 1)
  mb=$(( $(stat -c %s "$wheel") / 1048576 ))
  echo "== $wheel: ${mb} MB, built in $((SECONDS - start)) s$([ -n "$libs" ] && echo " (per-arch libraries reused)")"
  unzip -l "$wheel" | grep -E "libmoe_kernels_.*\.so|_C\." || true
  if [ "$mb" -gt "${MAX_WHEEL_MB:-100}" ]; then
    echo "$wheel is ${mb} MB, over ${MAX_WHEEL_MB:-100} MB" >&2
    exit 1
  fi
  if [ -z "$libs" ]; then  # the per-arch libraries of the first wheel, for the others
    libs=$(realpath -m "build/arch-libs-cu$MOE_KERNELS_CUDA")
    rm -rf "$libs" && mkdir -p "$libs"
    unzip -q -j -o "$wheel" 'moe_kernels/libmoe_kernels_*.so' -d "$libs"
  fi
done
