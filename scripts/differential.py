"""The long run of the differential test: random workloads (tests/differential.py), seed
after seed, until the time is up; every answer compared with vLLM alone's.

    .venv/bin/python scripts/differential.py --minutes 60 [--first-seed 1000]

Prints each seed's differences as they come and a summary line at the end; exits 1 if any
seed differed. Rebuild a failing seed's workload with ``tests.differential.workload(seed)``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--first-seed", type=int, default=1000,
                    help="CI runs seeds 0-2; start elsewhere to try new workloads")
    ap.add_argument("--engines", type=int, default=4, help="connector engines per seed")
    ap.add_argument("--kind", choices=("prefix", "blend", "both"), default="both",
                    help="prefix reuse workloads, blend ones (ratio 1.0), or each in turn")
    args = ap.parse_args()

    from tqdm import tqdm

    from kvconnector.tiny_model import build_tiny_mistral
    from tests import differential
    from tests.blend_models import build_model, tiny_tokenizer_dir
    from tests.conftest import CACHE
    from tests.redis_server import RedisServer

    models = {"prefix": str(build_tiny_mistral(CACHE / "tiny-mistral")),
              "blend": build_model(CACHE / "tiny-mistral-qk4", tiny_tokenizer_dir(CACHE),
                                   arch="mistral", qk_scale=4.0)}
    kinds = ["prefix", "blend"] if args.kind == "both" else [args.kind]
    deadline = time.monotonic() + args.minutes * 60
    seeds = failed = requests = 0
    with RedisServer() as redis, tempfile.TemporaryDirectory() as tmp, \
            tqdm(total=int(args.minutes * 60), unit="s", desc="differential") as bar:
        seed = args.first_seed
        while time.monotonic() < deadline:
            start = time.monotonic()
            kind = kinds[seed % len(kinds)]
            make = differential.workload if kind == "prefix" else differential.blend_workload
            w = make(seed, redis.url, n_engines=args.engines,
                     disk_dir=Path(tmp) / str(seed) / "disk")
            try:
                problems = differential.run(models[kind], Path(tmp) / str(seed), w)
            except RuntimeError as e:  # an engine that failed or hung is a finding too
                problems = [f"seed {seed}: {e}"]
            seeds += 1
            requests += sum(len(b) for bs in w.batches for b in bs)
            if problems:
                failed += 1
                tqdm.write("\n".join(problems))
            bar.update(int(time.monotonic() - start))
            bar.set_postfix(seeds=seeds, failed=failed)
            seed += 1
    print(f"differential ({args.kind}): {seeds} seeds ({args.first_seed}-{seed - 1}), "
          f"{requests} requests "
          f"on {seeds * args.engines} connector engines, {failed} seeds differed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
