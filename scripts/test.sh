#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (real vLLM engine, real Redis).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvconnector tests examples benchmarks
.venv/bin/python -m pytest -q -rs --durations=15 tests "$@"
