#!/usr/bin/env bash
# The one GPU check for the Triton kernels (see benchmarks/gpu_check.py): kernel tests on the
# GPU, kernel timings against torch and the copy-bandwidth floor, end-to-end greedy vs HF.
# Under ten minutes on one H200. Exits 2 with a message on a machine without a GPU.
#   benchmarks/gpu_check.sh [--cpu-smoke] [--model NAME_OR_PATH] [--out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$py" benchmarks/gpu_check.py "$@"
