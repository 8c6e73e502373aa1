#!/usr/bin/env bash
# GPU check of the engine on one CUDA GPU (NCCL, world size 1, bf16); see scripts/gpu_check.py.
# Exit status: 0 pass, 1 a check failed, 77 no CUDA GPU (skipped), 124 over 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# Decide before torchrun: without a GPU there is nothing to launch.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    exec "$PY" scripts/gpu_check.py  # prints why and exits 77
fi
exec timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu_check.py
