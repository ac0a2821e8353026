#!/usr/bin/env bash
# Prints the catalog arch (cmake/catalog.py ARCHS) of this machine's first GPU, or fails saying
# there is none for its compute capability. Used by ci/gpu-tests.sh and ci/gpu-ab.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '. ')
${PYTHON:-python3} - "$cc" <<'PY'
import sys
sys.path.insert(0, "cmake")
import catalog
cc = sys.argv[1]
archs = [a for a, spec in catalog.ARCHS.items() if "%d%d" % spec["cc"] == cc]
if not archs:
    sys.exit(f"no catalog arch for compute capability {cc} (cmake/catalog.py ARCHS)")
print(archs[0])
PY
