#!/usr/bin/env bash
# GPU check of the engine (see scripts/gpu_check.py and docs/gpu.md): every CUDA path on one
# GPU (NCCL at world size 1), then, where two GPUs exist, the uneven collectives and an uneven
# engine plan at world size 2. Runs from the checkout (src/ on the path): no install needed
# beyond torch (and transformers for the model check).
# Exit status: 0 pass, 1 a check failed, 77 no CUDA GPU (skipped), 124 a part ran over its limit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# Decide before torchrun: without a GPU there is nothing to launch.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    exec "$PY" scripts/gpu_check.py  # prints why and exits 77
fi
status=0
timeout 540 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu_check.py "$@" || status=$?
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    timeout 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        scripts/gpu_check.py --collectives || status=$?
else
    echo "gpu_check: world size 2 SKIPPED - $gpus CUDA GPU visible (NCCL needs one GPU per rank)"
fi
exit "$status"
