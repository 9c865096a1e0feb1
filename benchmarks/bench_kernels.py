"""Bandwidth of the Triton gather/scatter kernels and of the pinned-host transfer path.

Mistral-7B shapes (32 layers, 8 KV heads, head_dim 128, block size 16, 256-token chunks).
Each row compares, in the same run and for the same bytes:
- Triton gather / scatter vs one device-to-device copy (goal: ratio >= 0.9), and vs the
  torch reference;
- gather + D2H through ``host_transfer`` vs a raw pinned D2H copy, and H2D + scatter vs a
  raw pinned H2D copy (goal: ratio >= 0.9).
GB/s counts payload bytes (the chunks' size) once. Times are medians of CUDA-event timings.

    python benchmarks/bench_kernels.py --out bench.json
    python benchmarks/bench_kernels.py --smoke   # CPU: one tiny shape under the interpreter
    python benchmarks/bench_kernels.py --replot a.json b.json --plot kernels.png  # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

V032_ORDERS = {  # vLLM 0.32 KVCacheLayout: physical order of the logical [L, B, H, N, C] axes
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUTS = list(V032_ORDERS)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="LBNHC,LBHNC",
                   help=f"comma list from {','.join(LAYOUTS)} (LBNHC = NHD, LBHNC = HND)")
    p.add_argument("--dtypes", default="fp16,bf16", help=f"comma list from {','.join(DTYPES)}")
    p.add_argument("--chunks", default="1,2,4,8,16", help="chunks per batch, comma list")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV cache blocks per layer (default: 2x what the largest batch uses)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed runs; the median is reported")
    p.add_argument("--ref-iters", type=int, default=3, help="timed runs of the torch reference")
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference")
    p.add_argument("--no-host", action="store_true", help="skip the host transfer rows")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="draw each row's ratios against its baseline to this PNG")
    p.add_argument("--replot", nargs="+", metavar="JSON",
                   help="run nothing: draw --plot from these --out files")
    p.add_argument("--smoke", action="store_true",
                   help="no GPU needed: one tiny shape under the Triton CPU interpreter, "
                        "only to exercise the code path (numbers mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layouts, args.dtypes, args.chunks = "LBNHC,BLHNC", "fp16", "1,2"
        args.layers, args.heads, args.head_size, args.block_size = 2, 2, 8, 16
        args.chunk_tokens, args.warmup, args.iters, args.ref_iters = 32, 1, 2, 1
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            p.error(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    if args.chunk_tokens % args.block_size:
        p.error("--chunk-tokens must be a multiple of --block-size")
    return args


def build_layers(name: str, args, num_blocks: int, dtype: torch.dtype, device: str):
    from kvconnector.layout import describe_layers

    L, B, N, H, D = args.layers, num_blocks, args.block_size, args.heads, args.head_size
    order = V032_ORDERS[name]
    logical = (L, B, H, N, 2 * D)
    phys = torch.empty([logical[i] for i in order], dtype=dtype, device=device)
    phys.view(_INT[phys.element_size()]).random_()
    full = phys.permute(*[order.index(i) for i in range(5)])
    layers = [full[i] for i in range(L)]
    return layers, describe_layers({f"layer{i}": t for i, t in enumerate(layers)},
                                   num_kv_heads=H, head_size=D)


def make_timer(cuda: bool, warmup: int):
    def timed(fn, reps: int) -> float:
        """Median seconds of ``fn``."""
        for _ in range(warmup):
            fn()
        if not cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            # Queue work ahead so the CPU's launch overhead is not timed as GPU time.
            torch.cuda._sleep(2_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    return timed


def bench_config(name, dtype_name, args, chunk_counts, timed, device, cuda):
    dtype = DTYPES[dtype_name]
    bpc = args.chunk_tokens // args.block_size
    need = max(chunk_counts) * bpc
    num_blocks = args.num_blocks or 2 * need
    if num_blocks < need:
        raise SystemExit(f"--num-blocks {num_blocks} < {need} blocks the largest batch needs")
    layers, layout = build_layers(name, args, num_blocks, dtype, device)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks, like a real cache
    xfer = None
    if cuda and not args.no_host:
        from kvconnector.kernels.host_transfer import HostTransfer

        xfer = HostTransfer(layers, layout, bpc, max_chunks=max(chunk_counts))
    return [{"layout": name, "dtype": dtype_name,
             **bench_batch(layers, layout, perm[:c * bpc].reshape(c, bpc).contiguous(), xfer,
                           args, timed, cuda)} for c in chunk_counts]


def bench_batch(layers, layout, ids, xfer, args, timed, cuda) -> dict:
    from kvconnector.kernels import reference, triton_copy

    if cuda:
        ids = ids.pin_memory()  # keeps the kernels' id upload asynchronous
    c = ids.shape[0]
    chunks = torch.empty((c, len(layers), *layout.chunk_shape(ids.shape[1])),
                         dtype=layout.dtype, device=layers[0].device)
    nbytes = chunks.numel() * chunks.element_size()

    def gbps(fn, reps=args.iters) -> float:
        return nbytes / timed(fn, reps) / 1e9

    check = torch.empty_like(chunks)
    reference.gather(layers, layout, ids, check)
    triton_copy.gather(layers, layout, ids, chunks)
    as_int = _INT[chunks.element_size()]
    row = {"chunks": c, "mib": nbytes / 2**20,
           "correct": bool(torch.equal(chunks.view(as_int), check.view(as_int)))}
    src, dst = check, torch.empty_like(chunks)
    row["d2d"] = gbps(lambda: dst.copy_(src))
    row["gather"] = gbps(lambda: triton_copy.gather(layers, layout, ids, chunks))
    row["scatter"] = gbps(lambda: triton_copy.scatter(chunks, layout, ids, layers))
    row["gather/d2d"] = row["gather"] / row["d2d"]
    row["scatter/d2d"] = row["scatter"] / row["d2d"]
    if not args.no_reference:
        row["ref_gather"] = gbps(lambda: reference.gather(layers, layout, ids, chunks),
                                 args.ref_iters)
        row["ref_scatter"] = gbps(lambda: reference.scatter(chunks, layout, ids, layers),
                                  args.ref_iters)
    if xfer is not None:
        host = xfer.alloc_host(c)
        stream = torch.cuda.current_stream()
        row["d2h"] = gbps(lambda: host.copy_(chunks, non_blocking=True))
        row["h2d"] = gbps(lambda: chunks.copy_(host, non_blocking=True))
        # The compute stream waits on the done event, so the end event times the whole path.
        row["save"] = gbps(lambda: stream.wait_event(xfer.save(ids, host)))
        row["load"] = gbps(lambda: stream.wait_event(xfer.load(host, ids)))
        row["save/d2h"] = row["save"] / row["d2h"]
        row["load/h2d"] = row["load"] / row["h2d"]
    return row


COLUMNS = [("layout", "{}"), ("dtype", "{}"), ("chunks", "{}"), ("mib", "{:.2f}"),
           ("correct", "{}"), ("gather", "{:.1f}"), ("scatter", "{:.1f}"), ("d2d", "{:.1f}"),
           ("gather/d2d", "{:.2f}"), ("scatter/d2d", "{:.2f}"), ("ref_gather", "{:.1f}"),
           ("ref_scatter", "{:.1f}"), ("save", "{:.1f}"), ("d2h", "{:.1f}"),
           ("save/d2h", "{:.2f}"), ("load", "{:.1f}"), ("h2d", "{:.1f}"), ("load/h2d", "{:.2f}")]


def print_table(rows: list[dict]) -> None:
    cols = [(k, f) for k, f in COLUMNS if any(k in r for r in rows)]
    cells = [[k for k, _ in cols]] + [[f.format(r[k]) if k in r else "-" for k, f in cols]
                                      for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for i, row in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("GB/s of chunk payload; ratios are same-run, same-bytes (goal >= 0.9).")


RATIOS = {"gather/d2d": "gather vs device copy", "scatter/d2d": "scatter vs device copy",
          "save/d2h": "gather + D2H vs pinned D2H", "load/h2d": "H2D + scatter vs pinned H2D"}


def plot(path: str, rows: list[dict], device: str) -> None:
    """One panel per ratio: each layout and dtype a line over chunks per batch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(RATIOS), figsize=(4 * len(RATIOS), 3.6), sharey=True)
    for ax, (key, title) in zip(axes, RATIOS.items(), strict=True):
        configs = sorted({(r["layout"], r["dtype"]) for r in rows if key in r})
        for lay, dt in configs:
            mine = sorted((r["chunks"], r[key]) for r in rows
                          if (r["layout"], r["dtype"]) == (lay, dt) and key in r)
            ax.plot(*zip(*mine, strict=True), marker="o", ms=3, lw=1, label=f"{lay} {dt}")
        ax.axhline(0.9, color="red", ls="--", lw=0.8, label="goal 0.9")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunks per batch (256 tokens each)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s ratio, same run, same bytes")
    axes[-1].legend(fontsize=6)
    fig.suptitle(f"Triton kernels and host transfers, Mistral-7B shapes, {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def replot(files: list[str], path: str) -> int:
    runs = [json.load(open(f)) for f in files]
    devices = sorted({r["device"] for r in runs})
    plot(path, [row for r in runs for row in r["rows"]], ", ".join(devices))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        if not args.plot:
            print("--replot needs --plot PATH", file=sys.stderr)
            return 2
        return replot(args.replot, args.plot)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("bench_kernels.py needs a CUDA GPU; run with --smoke to exercise the code path "
              "on CPU under the Triton interpreter", file=sys.stderr)
        return 2
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_copy defines its kernel
    device = "cuda" if cuda else "cpu"
    device_name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, smoke)"
    print(f"device: {device_name}")
    chunk_counts = [int(x) for x in args.chunks.split(",")]
    configs = [(lay, dt) for lay in args.layouts.split(",") for dt in args.dtypes.split(",")]
    try:
        from tqdm import tqdm

        configs = tqdm(configs, desc="layouts x dtypes", file=sys.stderr)
    except ImportError:
        pass
    timed = make_timer(cuda, args.warmup)
    rows = []
    for lay, dt in configs:
        rows += bench_config(lay, dt, args, chunk_counts, timed, device, cuda)
        if cuda:
            torch.cuda.empty_cache()  # the next layout's KV cache needs the room
    print_table(rows)
    if not cuda:
        print("host transfer rows need CUDA: skipped")
    if args.out:
        meta = {"device": device_name, "torch": torch.__version__,
                "shape": {k: getattr(args, k) for k in ("layers", "heads", "head_size",
                                                        "block_size", "chunk_tokens")},
                "iters": args.iters, "smoke": args.smoke}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")
    if args.plot and cuda:
        plot(args.plot, rows, device_name)
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
