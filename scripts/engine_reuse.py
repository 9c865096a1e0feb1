"""Engines the test suite started more than once with the same configuration, from the log
``KVCONNECTOR_TEST_ENGINE_LOG=FILE`` makes (tests/conftest.py):

    KVCONNECTOR_TEST_ENGINE_LOG=/tmp/engines.jsonl bash scripts/test.sh
    .venv/bin/python scripts/engine_reuse.py /tmp/engines.jsonl

Configurations that hold a fresh directory or port (disk_path, redis_url) differ per test by
construction; what repeats is a candidate for a module-scoped engine.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    by_config: dict[str, list[str]] = defaultdict(list)
    total = 0
    for line in open(path):
        row = json.loads(line)
        total += 1
        by_config[json.dumps(row["config"], sort_keys=True)].append(row["test"])
    repeated = {c: t for c, t in by_config.items() if len(t) > 1}
    print(f"{total} engines, {len(by_config)} distinct configurations, "
          f"{sum(len(t) - 1 for t in repeated.values())} started again")
    for config, tests in sorted(repeated.items(), key=lambda x: -len(x[1])):
        print(f"\n{len(tests)}x {config[:300]}")
        for t in sorted(set(tests)):
            print(f"    {t} ({tests.count(t)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
