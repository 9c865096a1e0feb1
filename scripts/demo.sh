#!/usr/bin/env bash
# Sets everything up, then runs the prefix-reuse demo on the default in-memory store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/reuse.py "$@"
