"""The synchronous load of a memory hit, piece by piece, on tensors shaped like the CPU build's.

    python benchmarks/bench_load_path.py [--tokens 8192] [--repeats 30]

vLLM's CPU cache: one allocation, a ``[blocks, heads, 128, 2 * head_size]`` view per layer
(whole (block, head) pages move); kvconnector's pool: ``[slots, layers, 1, blocks_per_chunk,
heads, 128 * 2 * head_size]``. For a hit of ``--tokens`` tokens (256-token chunks), in one
run and on one thread (vLLM's CPU worker computes on the cores it binds; the copy runs on
the same thread as the forward):

* ``per-chunk scatter (before)``: ``kernels.reference.scatter`` once per chunk, as the worker
  did before this benchmark existed, plus ``crc32`` of every chunk (the old memory check);
  ``xxh3`` of every chunk: what that check would cost with today's checksum;
* ``index_copy_ per layer``: the step's chunks gathered from the pool, then one
  ``index_copy_`` per layer;
* ``runs (now)``: ``kernels/batched.py`` (block ids to runs, one strided copy per run);
  with slots and blocks in order (a request stored and loaded whole), and shuffled;
* ``contiguous copy``: the same bytes in one ``copy_`` (the floor for any copy).

Medians over ``--repeats``; milliseconds and GB/s of KV moved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_results  # noqa: E402

from kvconnector.kernels import reference  # noqa: E402
from kvconnector.kernels.batched import PagedCopier, block_runs  # noqa: E402
from kvconnector.layout import describe_layers  # noqa: E402
from kvconnector.store.codec import checksum  # noqa: E402

BLOCK, CHUNK = 128, 256
MODELS = {  # name: (layers, KV heads, head size)
    "tiny Mistral (bf16)": (2, 2, 32),
    "Mistral-7B geometry, 2 layers (bf16)": (2, 8, 128),
    "Mistral-7B geometry, 32 layers (bf16)": (32, 8, 128),
}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def case(layers: int, heads: int, head: int, tokens: int, shuffled: bool):
    chunks, bpc = tokens // CHUNK, CHUNK // BLOCK
    blocks = 2 * chunks * bpc + 8
    cache = torch.zeros(layers, blocks, heads, BLOCK, 2 * head, dtype=torch.bfloat16)
    views = [cache[i] for i in range(layers)]
    layout = describe_layers({f"l{i}": t for i, t in enumerate(views)}, num_kv_heads=heads,
                             head_size=head, cpu_pages=True)
    pool = torch.randn(chunks + 4, layers, *layout.chunk_shape(bpc)).to(torch.bfloat16)
    rng = random.Random(0)
    slots = rng.sample(range(chunks + 4), chunks) if shuffled else list(range(chunks))
    ids = rng.sample(range(blocks), chunks * bpc) if shuffled else list(range(chunks * bpc))
    plan = [(s, ids[i * bpc:(i + 1) * bpc]) for i, s in enumerate(slots)]
    return views, cache, layout, pool, plan


def measure(layers: int, heads: int, head: int, tokens: int, repeats: int) -> dict:
    views, cache, layout, pool, plan = case(layers, heads, head, tokens, shuffled=False)
    nbytes = pool[0].numel() * pool.element_size() * len(plan)
    copier = PagedCopier(views, layout)

    def per_chunk() -> None:
        for slot, ids in plan:
            zlib.crc32(pool[slot].view(torch.uint8).reshape(-1).numpy())
            reference.scatter(pool[slot][None], layout, torch.tensor([ids]), views)

    def crc_only() -> None:
        for slot, _ in plan:
            zlib.crc32(pool[slot].view(torch.uint8).reshape(-1).numpy())

    def xxh3_only() -> None:
        for slot, _ in plan:
            checksum(pool[slot].view(torch.uint8).reshape(-1).numpy())

    def index_copy() -> None:
        slots = torch.tensor([s for s, _ in plan])
        idx = torch.tensor([b for _, ids in plan for b in ids])
        for li, t in enumerate(views):
            dst = layout.view(t)[0]
            src = pool[slots, li, 0].reshape(-1, *dst.shape[1:])
            dst.index_copy_(0, idx, src)

    def runs() -> None:
        copier.scatter(pool, block_runs(plan))

    n = len(plan) * CHUNK // BLOCK

    def contiguous() -> None:
        cache[:, :n].copy_(cache[:, n:2 * n])

    out = {"per-chunk scatter + crc32 (before)": median_ms(per_chunk, repeats),
           "  of which crc32": median_ms(crc_only, repeats),
           "xxh3 of every chunk (a re-check now)": median_ms(xxh3_only, repeats),
           "index_copy_ per layer": median_ms(index_copy, repeats),
           "runs, in order (now)": median_ms(runs, repeats)}
    views, cache, layout, pool, plan = case(layers, heads, head, tokens, shuffled=True)
    copier = PagedCopier(views, layout)
    out["runs, shuffled slots and blocks (now)"] = median_ms(runs, repeats)
    out["one contiguous copy (floor)"] = median_ms(contiguous, repeats)
    return {"bytes": nbytes, "ms": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name, (layers, heads, head) in MODELS.items():
        res = measure(layers, heads, head, args.tokens, args.repeats)
        results[name] = res
        print(f"\n{name}: {args.tokens} tokens, {res['bytes'] / 2**20:.0f} MiB")
        for label, ms in res["ms"].items():
            print(f"  {label:<40} {ms:8.3f} ms  {res['bytes'] / ms / 1e6:6.1f} GB/s")
    out = write_results(args.out, "load_path", {"tokens": args.tokens, "results": results})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
