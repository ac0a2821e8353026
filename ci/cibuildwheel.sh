#!/usr/bin/env bash
# Release wheels for every supported Python and platform with cibuildwheel (needs Docker):
# moe-kernels-cu13 from this tree, moe-kernels-cu12 from a renamed copy (as ci/build-wheel.sh).
# The configuration is pyproject.toml's [tool.cibuildwheel]: manylinux_2_28, CPython 3.9-3.13,
# x86_64 and aarch64, the per-arch libraries built once per platform, auditwheel repair without
# libcuda.so.1, and a test that imports the package, runs `info` and the CPU tests.
#
#   ci/cibuildwheel.sh                     # both CUDA majors, wheels in wheelhouse/
#   CUDA_MAJORS=13 CIBW_ARCHS=x86_64 ci/cibuildwheel.sh
#
# cu13 takes its toolkit from PyPI (pyproject.toml's build requirements). PyPI has no CUDA 12
# nvcc: the cu12 build needs an image with the toolkit, given as CIBW_MANYLINUX_X86_64_IMAGE /
# CIBW_MANYLINUX_AARCH64_IMAGE (a manylinux_2_28 image with CUDA 12.9 installed) and
# CUDA12_NVCC (its nvcc's path inside the image).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v docker > /dev/null || { echo "cibuildwheel needs Docker (for a local wheel without it: ci/build-wheel.sh)" >&2; exit 1; }
python3 -m pip install -q "cibuildwheel==3.3.0"
OUT=$(realpath -m "${OUT_DIR:-wheelhouse}")
for cuda in ${CUDA_MAJORS:-13 12}; do
  src=.
  export MOE_KERNELS_CUDA=$cuda
  unset CUDACXX
  if [ "$cuda" != 13 ]; then
    [ -n "${CUDA12_NVCC:-}" ] && [ -n "${CIBW_MANYLINUX_X86_64_IMAGE:-}" ] || {
      echo "cu12: set CIBW_MANYLINUX_X86_64_IMAGE (an image with CUDA 12.9) and CUDA12_NVCC" >&2; exit 1; }
    export CUDACXX=$CUDA12_NVCC
    src=$(mktemp -d)/moe-kernels
    mkdir -p "$src"
    git ls-files -z | xargs -0 cp --parents -t "$src"
    sed -i "s/^name = \"moe-kernels-cu13\"/name = \"moe-kernels-cu$cuda\"/" "$src/pyproject.toml"
    sed -i '/^  "cuda-toolkit\[/d; /^  "nvidia-cuda-\|^  "nvidia-nvvm/d' "$src/pyproject.toml"
  fi
  python3 -m cibuildwheel --platform linux --output-dir "$OUT" "$src"
done
ls -l "$OUT"
