#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (real vLLM engine, real Redis).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvconnector tests examples benchmarks
# Two workers, whole modules each (their engines are module fixtures), one core each for
# their engines (tests/conftest.py): an engine computes on one core and a test spends much
# of its time starting engines, so two at once finish the suite sooner. "-n 0": one process.
workers=$(( $(nproc) >= 2 ? 2 : 1 ))
.venv/bin/python -m pytest -q -rs --durations=15 -n "$workers" --dist loadfile \
  --no-loadscope-reorder tests "$@"
