#!/usr/bin/env bash
# Prints the catalog arch (cmake/catalog.py ARCHS) of this machine's first GPU, or fails saying
# there is none for its compute capability. Used by ci/gpu-tests.sh and ci/gpu-ab.sh.
set -euo pipefail
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '. ')
case "$cc" in
  90) echo 90a ;;
  100) echo 100a ;;
  103) echo 103a ;;
  *) echo "no catalog arch for compute capability $cc (cmake/catalog.py ARCHS)" >&2; exit 2 ;;
esac
