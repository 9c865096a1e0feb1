"""A memory hit loaded by layer beside the forward pass against one loaded before it, in
the same engines (issue 24; ``load_by_layer``, ``kvconnector/layer_loads.py``).

    python benchmarks/bench_load_by_layer.py --model .cache/smollm2 --dtype bfloat16 \\
        --lengths 2048,4096 --repeats 6 --engines 2

Engines of one configuration differ by 10-30% on the 2-core machine (docs/benchmarks.md
section 15), more than the few milliseconds a load's copy is; so each engine serves every
prompt's hit both ways: a first request stores the prompt, then two hits load it, one by
layer and one before the forward (which one goes first alternates from prompt to prompt),
the worker switched between them. Each hit follows the same pause and short request as in
``bench_peers.py``. Both hits of a prompt must give the same greedy token. Reported: the
median TTFT each way, their ratio per engine and over all, and the connector's phase timers
per hit (``layer_copy``: the helper's copy; ``wait_for_layer_load``: what the forward waited).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from common import (
    add_model_args,
    connector,
    connector_seconds,
    engine,
    in_fresh_process,
    machine,
    random_prompt,
    resolve_model,
    timed_generate,
    write_results,
)

MODES = ("by layer", "before the forward")
# collective_rpc with a function (the switch): vLLM's engine core takes it only pickled.
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def _switch(worker, on: bool, min_layers: int | None) -> bool:
    """On the worker: loads by layer on or off (and their floor of layers, if given);
    whether the next big load will go by layer."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector import layer_loads

    if min_layers is not None:
        layer_loads.MIN_LAYERS = min_layers
    loads = get_kv_transfer_group().worker.by_layer
    loads.enabled = on
    return loads.usable(1 << 40)


def run_engine(model: str, args, seed: int) -> dict:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _switch, to the worker
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(seed)
    ttft = {m: {n: [] for n in lengths} for m in MODES}
    phases: dict[str, dict[int, dict[str, float]]] = {m: {n: {} for n in lengths}
                                                      for m in MODES}
    max_len = max(lengths) + 64
    with engine(model, args, connector({"memory_capacity": args.memory_capacity}), max_len,
                enable_prefix_caching=False, max_num_batched_tokens=max_len,
                disable_log_stats=False) as llm:
        short = random_prompt(random.Random(8), 16, args.vocab)

        def timers() -> dict[str, float]:
            time.sleep(0.3)
            timed_generate(llm, [short], 1)
            return connector_seconds()

        try:
            same = _hits(llm, args, lengths, rng, timers, ttft, phases)
        finally:  # else this process's exit waits for the engine core forever
            llm.llm_engine.engine_core.shutdown()
    return {"ttft": ttft, "phases": phases, "same_tokens": same}


def _hits(llm, args, lengths: list[int], rng: random.Random, timers, ttft: dict,
          phases: dict) -> bool:
    """Every prompt stored, then hit both ways; whether both hits gave the same token."""
    same = True
    timed_generate(llm, [random_prompt(random.Random(9), 300, args.vocab)], 1)
    for n in lengths:
        for i in range(args.repeats):
            p = random_prompt(rng, n, args.vocab)
            timed_generate(llm, [p], 1)  # stores it
            tokens = []
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                went = llm.collective_rpc(_switch, args=(mode == "by layer",
                                                         args.min_layers))
                assert all(went) == (mode == "by layer"), (mode, went)
                before = timers()
                secs, outs = timed_generate(llm, [p], 1)
                after = timers()
                ttft[mode][n].append(secs)
                tokens.append(list(outs[0].outputs[0].token_ids))
                for k, v in after.items():
                    d = phases[mode][n]
                    d[k] = d.get(k, 0.0) + (v - before.get(k, 0.0)) / args.repeats
            same = same and tokens[0] == tokens[1]
    return same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=6, help="prompts per length and engine")
    p.add_argument("--engines", type=int, default=2, help="fresh engines, one after another")
    p.add_argument("--min-layers", type=int, default=None,
                   help="loads by layer for models with this many layers or more (default: "
                        "kvconnector's MIN_LAYERS; 0 to measure the tiny model's 2 layers)")
    args = p.parse_args()
    model, args.vocab = resolve_model(args)
    engines = [in_fresh_process(run_engine, model, args, seed)
               for seed in range(args.engines)]
    lengths = [int(x) for x in args.lengths.split(",")]
    table: dict[int, dict] = {}
    print(f"\nmemory hit TTFT, model {model} ({args.dtype}), {args.repeats} prompts x "
          f"{args.engines} engines, each hit both ways")
    for n in lengths:
        med = {m: statistics.median(t for e in engines for t in e["ttft"][m][n]) for m in MODES}
        per_engine = [statistics.median(e["ttft"]["by layer"][n])
                      / statistics.median(e["ttft"]["before the forward"][n]) for e in engines]
        table[n] = {"ttft_s": med, "by_layer_vs_before": med["by layer"] / med[MODES[1]],
                    "per_engine": per_engine}
        print(f"  {n:>6} tokens: by layer {med['by layer'] * 1e3:.1f} ms, before the forward "
              f"{med[MODES[1]] * 1e3:.1f} ms: {table[n]['by_layer_vs_before']:.3f}x "
              f"(per engine {', '.join(f'{r:.3f}x' for r in per_engine)})")
        for m in MODES:
            keys = {k for e in engines for k in e["phases"][m][n]}
            ph = {k: statistics.mean(e["phases"][m][n].get(k, 0.0) for e in engines)
                  for k in keys}
            print(f"    {m}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in
                                           sorted(ph.items(), key=lambda kv: -kv[1])
                                           if v >= 5e-5))
    same = all(e["same_tokens"] for e in engines)
    print("greedy tokens of both hits of every prompt " + ("equal" if same else "DIFFER"))
    path = write_results(args.out, "load_by_layer", {
        "model": model, "dtype": args.dtype, "lengths": lengths, "repeats": args.repeats,
        "engines": args.engines, "machine": machine(), "results": table,
        "same_tokens": same, "runs": engines})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
