#!/usr/bin/env bash
# The one GPU check for the Triton kernels (see benchmarks/gpu_check.py): kernel tests on the
# GPU, kernel timings against torch and the copy-bandwidth floor, end-to-end greedy vs HF
# (and at tensor-parallel size 2 over NCCL when two GPUs are visible).
# Under ten minutes on one H200. Exits 2 with a message on a machine without a GPU.
#   benchmarks/gpu_check.sh [--cpu-smoke] [--model NAME_OR_PATH] [--out FILE] [--peers]
# --peers then also runs the peer benchmark against the regular vllm wheel (installed into
# .venv-vllm by scripts/install_vllm.sh, which picks the CUDA wheel where nvidia-smi lists a GPU;
# a few minutes more): benchmarks/peers.py --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
# proto/ holds the generated gRPC stubs (package `tandem`), importable without installing the project.
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
peers=0
args=()
for a in "$@"; do
  if [[ "$a" == "--peers" ]]; then peers=1; else args+=("$a"); fi
done
status=0
"$py" benchmarks/gpu_check.py "${args[@]}" || status=$?
if [[ $peers == 1 && $status != 2 ]]; then
  "$py" benchmarks/peers.py --device cuda --install-vllm --systems vllm,colocated,disaggregated \
    --output-dir bench-results/peers-gpu || status=$?
fi
exit $status
