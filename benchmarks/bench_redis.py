"""Put/get throughput of RedisStore against redis-benchmark, on the same server and sizes.

    .venv/bin/python benchmarks/bench_redis.py [--url redis://127.0.0.1:6379] \
        [--sizes 64K,2M,32M] [--depths 1,8] [--seconds 0.5] [--rounds 5] [--out bench.json]

Without ``--url`` a redis-server is started (tests/redis_server.py) and stopped at the end.
For each value size and pipeline depth it measures, in the same run:

* ``store``: RedisStore.put_many / get_many (get: the codec's checks, checksum included, and
  a new buffer per value; ``get-out``: into caller buffers, as a worker reading into a
  pinned pool would); ``exists`` for a 64-key prefix;
* ``redis-benchmark``: ``-t set,get -c 1 -P <depth> -d <size>`` (one client, like a
  worker's call); its payload is the same size, without the ~150-byte codec header;
* ``raw-socket``: the floor for Python: commands packed before the clock starts, written
  with sendall, replies read with recv_into into one reused buffer (no checks);
* ``redis-py``: redis-py's own pipeline (``Pipeline.set``/``get``), for reference;
* ``public``: what the store would do through redis-py's public API alone (issue 22): SETs of
  the codec header + payload joined into one value (a SET value is one argument: the join
  is a copy the hand-written path does not make) with ``conn.pack_command`` /
  ``pack_commands`` and ``conn.send_packed_command`` (pipelined at depth > 1), GETs the
  same way then ``conn.read_response`` and ``codec.parse`` (a new bytes per value; the
  public API cannot read a reply into a caller's buffer, so ``get-out`` copies the payload
  there), on one connection held for the run, as the store holds its own. With hiredis
  installed (the ``redis`` extra) redis-py packs with hiredis, which copies every argument
  into one command buffer (a memoryview through ``bytes()`` first);
* ``public-tuned``: the same with the public constructor arguments that help:
  ``command_packer=redis.connection.PythonRespSerializer(...)`` (passes arguments over
  6000 bytes, and memoryviews, through uncopied) and ``socket_read_size`` of 1 MiB (the
  reply parser reads 64 KiB per ``recv_into`` by default).

``public/store`` is public / store at the same size and depth (the better of the two public
paths per operation).

``ratio`` is store / redis-benchmark at the same size and depth (goal: >= 0.8). If no
redis-benchmark binary is found (PATH, then next to the redis-server in use), the ratio is
taken against ``raw-socket`` instead and the table says so.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import redis  # noqa: E402
from redis_server import RedisServer, find_redis_binary  # noqa: E402

from kvconnector.store import codec  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def human(n: int) -> str:
    for unit, m in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def timed(fn, per_call: int, seconds: float, min_calls: int = 3) -> float:
    """ops/s of ``fn`` (``per_call`` ops per call), run for ``seconds`` after one warm-up."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and calls >= min_calls:
            return calls * per_call / elapsed


# ---- the store -------------------------------------------------------------------------

def bench_store(url: str, size: int, depth: int, seconds: float, cluster: bool) -> dict:
    store = RedisStore.from_url(url, key_prefix="bench", timeout_s=30.0, cluster=cluster)
    try:
        chunks = []
        for i in range(depth):
            payload = os.urandom(size)
            exp = codec.ExpectedChunk(f"{'ab' * 16}:0:{i:032x}", "chunk", "uint8", (size,), size)
            chunks.append((exp, codec.encode_header(exp, payload), memoryview(payload)))
        items = [(e.key, h, p) for e, h, p in chunks]
        keys = [e.key for e, _, _ in chunks]
        exps = [e for e, _, _ in chunks]
        outs = [bytearray(size) for _ in range(depth)]

        def put():
            assert store.put_many(items) == depth

        def get():
            assert all(v is not None for v in store.get_many(keys, exps))

        def get_out():
            assert all(v is not None for v in store.get_many(keys, exps, out=outs))

        res = {"put": timed(put, depth, seconds), "get": timed(get, depth, seconds),
               "get-out": timed(get_out, depth, seconds)}
        # encode cost (the caller's, done once per chunk): checksum + msgpack header
        res["encode_header"] = timed(lambda: codec.encode_header(chunks[0][0], chunks[0][2]),
                                     1, min(seconds, 0.5))
        snap = store.snapshot()
        assert snap["errors"] == 0 and snap["corrupt"] == 0, snap
        return res
    finally:
        store.close()


def bench_exists(url: str, seconds: float, cluster: bool, n_keys: int = 64) -> float:
    store = RedisStore.from_url(url, key_prefix="bench-exists", cluster=cluster)
    try:
        keys = [f"{'cd' * 16}:0:{i:032x}" for i in range(n_keys)]
        for k in keys:  # present, so every call reads all replies
            exp = codec.ExpectedChunk(k, "chunk", "uint8", (1,), 1)
            store.put_many([(k, codec.encode_header(exp, b"x"), memoryview(b"x"))])

        def look():
            assert store.exists_prefix(keys, 1.0) == n_keys

        return timed(look, 1, seconds)
    finally:
        store.close()


# ---- baselines -------------------------------------------------------------------------

def find_benchmark_binary(server_binary: str | None) -> str | None:
    try:
        return find_redis_binary("redis-benchmark")
    except FileNotFoundError:
        pass
    if server_binary:
        candidate = Path(server_binary).with_name("redis-benchmark")
        if candidate.exists():
            return str(candidate)
    return None


def bench_redis_benchmark(binary: str, host: str, port: int, password: str | None, size: int,
                          depth: int, seconds: float, rough_gbps: float) -> dict:
    # as many requests as fit in about ``seconds`` at the rate seen so far
    n = max(depth * 4, int(seconds * rough_gbps * 1e9 / size) // depth * depth)
    n = min(n, 200_000)
    cmd = [binary, "-h", host, "-p", str(port), "-t", "set,get", "-c", "1", "-P", str(depth),
           "-d", str(size), "-n", str(n), "--csv"]
    if password:
        cmd += ["-a", password]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"redis-benchmark failed: {out.stderr[-300:]}")
    rows = {r["test"]: float(r["rps"]) for r in csv.DictReader(io.StringIO(out.stdout))}
    return {"put": rows["SET"], "get": rows["GET"], "requests": n}


def _parse_url(url: str) -> tuple[str, int, str | None]:
    kw = redis.connection.parse_url(url)
    return kw.get("host", "127.0.0.1"), int(kw.get("port", 6379)), kw.get("password")


def bench_raw_socket(url: str, size: int, depth: int, seconds: float) -> dict:
    host, port, password = _parse_url(url)
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(size + 4096)
    view = memoryview(buf)
    pending = bytearray()

    def read_reply(into: memoryview | None = None) -> None:
        nonlocal pending
        while b"\r\n" not in pending:
            pending += sock.recv(65536)
        line, _, rest = bytes(pending).partition(b"\r\n")
        pending = bytearray(rest)
        if line[:1] == b"$":
            n = int(line[1:]) + 2
            take = min(n, len(pending))
            view[:take] = pending[:take]
            del pending[:take]
            got = take
            while got < n:
                got += sock.recv_into(view[got:n])
        elif line[:1] == b"-":
            raise RuntimeError(line.decode())

    if password:
        sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password.encode()))
        read_reply()
    value = os.urandom(size)
    keys = [b"raw:%d" % i for i in range(depth)]
    set_cmds = [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size) + value + b"\r\n"
                for k in keys]
    get_cmds = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)

    def put():
        for c in set_cmds:
            sock.sendall(c)
        for _ in keys:
            read_reply()

    def get():
        sock.sendall(get_cmds)
        for _ in keys:
            read_reply()

    try:
        return {"put": timed(put, depth, seconds), "get": timed(get, depth, seconds)}
    finally:
        sock.close()


def bench_redis_py(url: str, size: int, depth: int, seconds: float) -> dict:
    r = redis.Redis.from_url(url, protocol=2)
    try:
        value = os.urandom(size)
        keys = [f"rp:{i}" for i in range(depth)]

        def put():
            p = r.pipeline(transaction=False)
            for k in keys:
                p.set(k, value)
            p.execute()

        def get():
            p = r.pipeline(transaction=False)
            for k in keys:
                p.get(k)
            p.execute()

        return {"put": timed(put, depth, seconds), "get": timed(get, depth, seconds)}
    finally:
        r.close()


# ---- redis-py's public API, as the store would use it ---------------------------------

def _encode(arg) -> bytes | memoryview:
    return arg if isinstance(arg, (bytes, memoryview)) else str(arg).encode()


def bench_public(url: str, size: int, depth: int, seconds: float, tuned: bool) -> dict:
    kw: dict = {"protocol": 2, "health_check_interval": 0}
    if tuned:
        kw.update(command_packer=redis.connection.PythonRespSerializer(6000, _encode),
                  socket_read_size=1 << 20)
    r = redis.Redis.from_url(url, **kw)
    conn = r.connection_pool.get_connection()
    try:
        chunks = []
        for i in range(depth):
            payload = os.urandom(size)
            exp = codec.ExpectedChunk(f"{'ef' * 16}:0:{i:032x}", "chunk", "uint8", (size,), size)
            chunks.append((b"pub:%d" % i, exp, codec.encode_header(exp, payload),
                           memoryview(payload)))
        outs = [memoryview(bytearray(size)) for _ in range(depth)]

        def send(cmds: list[tuple]) -> None:
            packed = conn.pack_command(*cmds[0]) if len(cmds) == 1 else conn.pack_commands(cmds)
            conn.send_packed_command(packed, check_health=False)

        def put():
            # A SET's value is one argument: header and payload joined (a copy).
            send([("SET", k, b"".join((h, p))) for k, _, h, p in chunks])
            assert all(conn.read_response() == b"OK" for _ in chunks)

        def get(into: bool) -> None:
            send([("GET", k) for k, _, _, _ in chunks])
            for i, (_, exp, _, _) in enumerate(chunks):
                payload = codec.parse(conn.read_response(), exp)
                if into:
                    outs[i][:size] = payload

        return {"put": timed(put, depth, seconds), "get": timed(lambda: get(False), depth, seconds),
                "get-out": timed(lambda: get(True), depth, seconds)}
    finally:
        r.connection_pool.release(conn)
        r.close()


# ---- main ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (default: start one)")
    ap.add_argument("--cluster", action="store_true", help="--url is a Redis Cluster node")
    ap.add_argument("--sizes", default="64K,2M,32M")
    ap.add_argument("--depths", default="1,8", help="values per call (pipeline depth)")
    ap.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds per case; the table shows medians")
    ap.add_argument("--no-redis-py", action="store_true", help="skip the redis-py reference")
    ap.add_argument("--no-public", action="store_true",
                    help="skip the public-API paths (public, public-tuned)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    server = None
    server_binary = None
    if args.url:
        url = args.url
    else:
        server = RedisServer().start()
        url, server_binary = server.url, server.binary
    try:
        host, port, password = _parse_url(url)
        bench_bin = find_benchmark_binary(server_binary)
        with redis.Redis.from_url(url, protocol=2) as r:
            server_version = r.info("server").get("redis_version")
        tasks = [(s, d) for s in sizes for d in depths]
        bar = tqdm(total=len(tasks) * args.rounds + 1, desc="bench", unit="step") if tqdm \
            else None
        results = []
        for size, depth in tasks:
            rounds: dict[str, list[dict]] = {}
            for r in range(args.rounds):  # interleaved, so that a noisy spell hits all
                if bar:
                    bar.set_postfix_str(f"{human(size)} x{depth} round {r + 1}")
                one = {"store": bench_store(url, size, depth, args.seconds, args.cluster)}
                if not args.cluster:
                    one["raw-socket"] = bench_raw_socket(url, size, depth, args.seconds)
                    if not args.no_redis_py:
                        one["redis-py"] = bench_redis_py(url, size, depth, args.seconds)
                    if not args.no_public:
                        for name, tuned in (("public", False), ("public-tuned", True)):
                            one[name] = bench_public(url, size, depth, args.seconds, tuned)
                if bench_bin and not args.cluster:
                    rough = max(one["store"]["put"], one["store"]["get"]) * size / 1e9
                    try:
                        one["redis-benchmark"] = bench_redis_benchmark(
                            bench_bin, host, port, password, size, depth, args.seconds, rough)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        one["redis-benchmark"] = {"error": str(e)}
                for name, res in one.items():
                    rounds.setdefault(name, []).append(res)
                if bar:
                    bar.update()
            row: dict = {"size": size, "depth": depth, "rounds": rounds}
            for name, runs in rounds.items():
                ops = {op for run in runs for op in run if op not in ("error", "requests")}
                row[name] = {op: statistics.median(run[op] for run in runs if op in run)
                             for op in ops}
            base_name = "redis-benchmark" if "put" in row.get("redis-benchmark", {}) \
                else "raw-socket"
            base = row.get(base_name, {})
            row["baseline"] = base_name
            row["ratio"] = {op: row["store"][op] / base[op] for op in ("put", "get")
                            if base.get(op)}
            if base.get("get"):
                row["ratio"]["get-out"] = row["store"]["get-out"] / base["get"]
            if "public" in row:
                row["public/store"] = {
                    op: max(row[p][op] for p in ("public", "public-tuned")) / row["store"][op]
                    for op in ("put", "get", "get-out")}
            results.append(row)
        exists_rate = bench_exists(url, args.seconds, args.cluster)
        if bar:
            bar.update()
            bar.close()
    finally:
        if server:
            server.stop()

    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "redis_server": server_version,
                    "redis_py": redis.__version__, "redis_benchmark": bench_bin},
        "seconds_per_measurement": args.seconds, "rounds": args.rounds,
        "results": results,
        "exists_prefix_64_keys_per_s": exists_rate,
    }
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    m = report["machine"]
    print(f"\nredis-server {m['redis_server']}, redis-py {m['redis_py']}, {m['cpus']} CPUs, "
          f"redis-benchmark: {m['redis_benchmark'] or 'NOT FOUND (baseline: raw-socket)'}")
    cols = ["store", "public", "public-tuned", "redis-benchmark", "raw-socket", "redis-py"]
    head = f"{'size':>8} {'depth':>5} {'op':<7}" + "".join(f"{c:>22}" for c in cols) + \
        f"{'ratio':>8}{'public/store':>13}"
    print(head)
    print("-" * len(head))
    for row in report["results"]:
        size = row["size"]
        for op in ("put", "get", "get-out"):
            cells = []
            for c in cols:
                src = row.get(c, {})
                own = c in ("store", "public", "public-tuned")  # these measure get-out
                rate = src.get(op if own else ("get" if op == "get-out" else op))
                if not own and op == "get-out":
                    rate = None
                cells.append(f"{rate:>9.0f}/s {rate * size / 1e9:6.2f}GB/s" if rate
                             else f"{'-':>22}")
            ratio = row["ratio"].get(op)
            public = row.get("public/store", {}).get(op)
            print(f"{human(size):>8} {row['depth']:>5} {op:<7}" + "".join(f"{c:>22}" for c in cells)
                  + (f"{ratio:>8.2f}" if ratio else f"{'-':>8}")
                  + (f"{public:>13.2f}" if public else f"{'-':>13}"))
    print(f"\nmedians of {report['rounds']} interleaved rounds; "
          f"ratio = store / {report['results'][0]['baseline']} (same size and depth); "
          f"public/store = the better public path / store; "
          f"exists_prefix(64 keys): {report['exists_prefix_64_keys_per_s']:.0f} calls/s")


if __name__ == "__main__":
    sys.exit(main())
