"""kvconnector in production, with real engines and a real 3-node Redis Cluster:

1. vLLM's OpenAI server with kvconnector: repeated prompts, a damaged value, a cluster node
   killed and restarted; its ``/metrics`` must show the numbers moving.
2. Two engines in separate processes (one configured by an LMCache YAML file) share the
   cluster and serve each other's chunks with the tokens they computed themselves.
3. While they wait, the ``kvconnector`` command looks at, verifies and purges what the
   engines stored (the cluster, then a copy on a password-protected single server).
4. A node is killed while the engines run: misses only, the same tokens.

One module fixture runs all of it (one server and two engines in all); the tests assert.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvconnector.keys import chunk_hashes, request_seed
from kvconnector.store import descriptor
from tests.conftest import ROOT, prompt, run_engine
from tests.openai_server import OpenAIServer, cached_tokens
from tests.redis_server import RedisClusterServers, RedisServer

pytestmark = pytest.mark.engine

CHUNK = 256
HIT = 5 * 128  # a 700-token prompt: two full chunks and the one full block after them
STORED = 3  # chunks each such prompt stores: two full ones, one partial (that block)
CHUNK_BYTES = 256 << 10  # the tiny model, fp32: 2 layers x 2 blocks x 64 KiB pages
S1, S2, S3, S4, S5 = (prompt(400 + i, 700) for i in range(5))  # the server's
PA1, PA2, PB1, PB2 = (prompt(420 + i, 700) for i in range(4))  # engines A's and B's
PASSWORD = "s3cret-pass-do-not-print"
MAC_SECRET = "a-shared-secret-of-32-characters"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m kvconnector.cli``: what the ``kvconnector`` console script runs."""
    return subprocess.run([sys.executable, "-m", "kvconnector.cli", *args],
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def cli_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    p = cli(*args, "--json", env=env)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else {}), p.stderr


def chunk_key(fp_hex: str, tokens: list[int], index: int) -> str:
    h = chunk_hashes(tokens, CHUNK, request_seed(bytes.fromhex(fp_hex), None))[index]
    return f"kvc:{fp_hex}:0:{h.hex()}"


def node_of(cluster: RedisClusterServers, key: str) -> RedisServer:
    return cluster.node_for_slot(key_slot(key.encode()))


def keys(cluster: RedisClusterServers, pattern: str) -> list[bytes]:
    out = []
    for node in cluster.nodes:
        if node.running:
            with node.client() as c:
                out += list(c.scan_iter(match=pattern, count=1000))
    return out


def descriptors(cluster: RedisClusterServers) -> dict[str, descriptor.Descriptor]:
    out = {}
    for k in keys(cluster, "kvc:fp:*"):
        with node_of(cluster, k.decode()).client() as c:
            out[k.decode().rsplit(":", 1)[1]] = descriptor.decode(c.get(k))
    return out


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.1)


def scrape(base: str) -> list:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("vllm:kvconnector_")]


def metric(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _serve(cluster: RedisClusterServers, model: str, tmp: Path) -> dict:
    extra = {"memory_capacity": "1MiB",  # 4 chunks: the third prompt evicts the first
             "redis_url": cluster.cluster_url, "namespace": "served",
             "redis_lookup_budget_ms": 10_000,
             "load_by_layer": True}  # "auto" would skip the tiny model's 2 layers
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    out: dict = {}
    with OpenAIServer(model, tmp, kvt, args=[
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096",
            "--dtype", "float32"]) as server:
        def ask(tokens: list[int]) -> dict:
            r = server.post("/v1/completions", {"prompt": tokens, "max_tokens": 8,
                                                "temperature": 0})
            return {"text": r["choices"][0]["text"], "cached": cached_tokens(r)}

        out["cold"] = []
        for i, p in enumerate((S1, S2, S3)):  # each one's chunks in Redis before the next
            out["cold"].append(ask(p))
            wait_until(lambda n=2 * (i + 1): len(keys(cluster, "kvc:*:0:*")) >= n, 30,
                       "the server's chunks in Redis")
        out["before"] = scrape(server.base)
        out["memory_hit"] = ask(S3)
        out["redis_hit"] = ask(S1)
        (fp,) = descriptors(cluster)
        out["fingerprint"] = fp
        rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        for i in range(2):  # flip the last payload byte of S2's chunks: a checksum error
            value = rc.get(chunk_key(fp, S2, i))
            rc.set(chunk_key(fp, S2, i), value[:-1] + bytes([value[-1] ^ 0xFF]))
        rc.close()
        out["after_corrupt"] = ask(S2)
        node = node_of(cluster, chunk_key(fp, S4, 0))
        node.kill()  # S4's lookup needs it, and so do its puts
        out["during_kill"] = ask(S4)
        node.start()
        cluster._wait_ok()
        time.sleep(1.5)  # past the first backoff (0.5 s): the next call probes
        out["after_restart"] = ask(S5)
        deadline = time.monotonic() + 60
        for n in itertools.count():  # stats travel with engine steps: step until they are in
            m = scrape(server.base)
            reconnected = metric(m, "vllm:kvconnector_redis_reconnects_total") >= 1
            if (reconnected and metric(m, "vllm:kvconnector_saved_chunks_total") >= 10
                    and metric(m, "vllm:kvconnector_redis_chunks_total", op="put") >= 8) \
                    or time.monotonic() > deadline:
                break
            # A slow machine can still have the restarted node in backoff when S5 asks:
            # new chunks reach it once the backoff is over. Else no full chunk: moves
            # nothing, reports everything.
            ask(prompt(600 + n, 700) if not reconnected else prompt(499, 50))
            time.sleep(0.5)
        out["after"] = m
        out["model"] = model
    return out


def _lmcache_file(tmp: Path, cluster: RedisClusterServers) -> Path:
    """Engine A's configuration, as an LMCache user has it: Valkey/Redis Cluster."""
    path = tmp / "lmcache.yaml"
    path.write_text(f"""\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.0625
remote_url: "valkey://127.0.0.1:{cluster.nodes[0].port}"
remote_serde: "naive"
save_decode_cache: true
extra_config:
  valkey_mode: "cluster"
""")
    return path


def _engine_spec(model: str, connector: dict, signals: Path, me: str, other: str,
                 mine: tuple, theirs: tuple, after_kill: list) -> dict:
    return {"model": model, "connector": connector, "signals": str(signals), "steps": [
        {"op": "generate", "prompts": [mine[0]]},  # 0: computed here
        {"op": "flush"},  # 1
        {"op": "signal", "name": f"{me}1"},  # 2
        {"op": "wait", "name": f"{other}1"},  # 3
        {"op": "generate", "prompts": [theirs[0]]},  # 4: the other engine's chunks
        {"op": "generate", "prompts": [mine[1]]},  # 5
        {"op": "flush"},  # 6
        {"op": "signal", "name": f"{me}2"},  # 7
        {"op": "wait", "name": "killed"},  # 8
        {"op": "generate", "prompts": after_kill},  # 9: a node is down
        {"op": "totals"}, {"op": "redis_stats"}]}  # 10, 11


def _cli_checks(cluster: RedisClusterServers, tmp: Path, served_fp: str) -> dict:
    """Everything the command does, on what the server and engines A and B stored."""
    out: dict = {}
    url = cluster.cluster_url
    out["stats"] = cli_json("stats", url)
    out["stats_node_url"] = cli_json("stats", cluster.nodes[1].url)  # finds the cluster
    out["stats_text"] = cli("stats", url, "--progress")
    rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    rc.set("kvc:not-ours", b"x")
    rc.set("elsewhere:key", b"y")
    served = sorted(k for k in keys(cluster, f"kvc:{served_fp}:*"))
    checksum_key, truncated_key = served[0], served[1]
    value = rc.get(checksum_key)
    rc.set(checksum_key, value[:-1] + bytes([value[-1] ^ 0x01]))
    rc.set(truncated_key, rc.get(truncated_key)[:-100])
    out["damaged"] = {checksum_key.decode(): "checksum", truncated_key.decode(): "truncated"}
    out["verify"] = cli_json("verify", url)
    out["verify_mac"] = cli_json("verify", url, "--mac-key-env", "KVC_MAC",
                                 env={"KVC_MAC": MAC_SECRET})
    out["verify_delete"] = cli_json("verify", url, "--delete")
    out["verify_again"] = cli_json("verify", url)
    out["purge_unasked"] = cli("purge", url, "--namespace", "served")
    out["purge_dry"] = cli_json("purge", url, "--namespace", "served", "--dry-run")
    out["purge"] = cli_json("purge", url, "--namespace", "served", "--yes")
    out["stats_after_purge"] = cli_json("stats", url)
    out["foreign_kept"] = (rc.get("kvc:not-ours"), rc.get("elsewhere:key"))
    with RedisServer(password=PASSWORD) as single:  # a copy on one server, with a password
        with single.client() as dst:
            for k in keys(cluster, "kvc:*"):
                dst.restore(k, 0, rc.dump(k), replace=True)
        port = single.port
        out["single_url_password"] = cli("stats", f"redis://:{PASSWORD}@127.0.0.1:{port}",
                                         "--json")
        out["single_env_password"] = cli_json("stats", f"redis://127.0.0.1:{port}",
                                              "--password-env", "KVC_PW",
                                              env={"KVC_PW": PASSWORD})
        out["single_no_password"] = cli("stats", f"redis://127.0.0.1:{port}")
        out["single_wrong_password"] = cli("stats", f"redis://:wrong-{PASSWORD}@127.0.0.1:"
                                                    f"{port}")
        out["single_verify"] = cli_json("verify", f"redis://:{PASSWORD}@127.0.0.1:{port}")
        out["single_purge_all"] = cli_json("purge", f"redis://:{PASSWORD}@127.0.0.1:{port}",
                                           "--all", "--yes")
        out["single_after"] = cli_json("stats", f"redis://127.0.0.1:{port}",
                                       "--password-env", "KVC_PW", env={"KVC_PW": PASSWORD})
    rc.close()
    return out


@pytest.fixture(scope="module")
def ops(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    with RedisClusterServers(3) as cluster:
        served = _serve(cluster, tiny_model, tmp / "server")
        signals = tmp / "signals"
        signals.mkdir()
        a_conn = {"lmcache_config_file": str(_lmcache_file(tmp, cluster)),
                  "redis_lookup_budget_ms": 10_000}  # two engines on two cores: be patient
        b_conn = {"memory_capacity": "64MiB", "redis_url": cluster.cluster_url,
                  "redis_lookup_budget_ms": 10_000}
        specs = {"a": _engine_spec(tiny_model, a_conn, signals, "a", "b", (PA1, PA2),
                                   (PB1, PB2), [PB2, PA1]),
                 "b": _engine_spec(tiny_model, b_conn, signals, "b", "a", (PB1, PB2),
                                   (PA1, PA2), [PA2, PB1])}
        with ThreadPoolExecutor(2) as pool:
            runs = {n: pool.submit(run_engine, tmp / f"engine-{n}", s, runner="ops_runner.py",
                                   timeout=420) for n, s in specs.items()}
            try:
                wait_until(lambda: all((signals / f"{n}2").exists() for n in runs)
                           or any(r.done() for r in runs.values()), 400, "both engines")
                if any(r.done() for r in runs.values()):
                    for r in runs.values():
                        if r.done():
                            r.result()  # raises the engine's failure
                shared = next(fp for fp, d in descriptors(cluster).items()
                              if d.namespace == "")
                commands = _cli_checks(cluster, tmp, served["fingerprint"])
                killed = node_of(cluster, chunk_key(shared, PB2, 0))
                killed.kill()  # engine A's next lookup needs this node
            finally:
                (signals / "killed").touch()
            engines = {n: r.result() for n, r in runs.items()}
        killed.start()
        cluster._wait_ok()
    return {"served": served, "engines": engines, "cli": commands, "shared": shared}


def test_server_metrics_move(ops):
    s = ops["served"]
    before, after = s["before"], s["after"]
    labels = {"model_name": s["model"], "engine": "0"}
    m = lambda name, **kw: metric(after, name, **labels, **kw)  # noqa: E731
    assert [r["cached"] for r in s["cold"]] == [0, 0, 0]
    assert s["memory_hit"] == {**s["cold"][2], "cached": HIT}
    assert s["redis_hit"] == {**s["cold"][0], "cached": HIT}
    assert s["after_corrupt"]["text"] == s["cold"][1]["text"]
    # Hits by tier, loads, saves and their latency.
    assert m("vllm:kvconnector_hit_tokens_total", tier="memory") >= HIT
    assert m("vllm:kvconnector_hit_tokens_total", tier="redis") >= HIT
    assert m("vllm:kvconnector_hit_tokens_total", tier="memory") > metric(
        before, "vllm:kvconnector_hit_tokens_total", tier="memory")
    assert m("vllm:kvconnector_loaded_chunks_total") >= 4
    assert m("vllm:kvconnector_loaded_bytes_total") >= 4 * CHUNK_BYTES
    saved = m("vllm:kvconnector_saved_chunks_total")
    assert saved >= 10 and saved > metric(before, "vllm:kvconnector_saved_chunks_total")
    saved_bytes = m("vllm:kvconnector_saved_bytes_total")  # partial chunks: fewer bytes
    assert saved * CHUNK_BYTES // 2 <= saved_bytes < saved * CHUNK_BYTES
    assert saved_bytes % (CHUNK_BYTES // 2) == 0  # whole 128-token blocks
    assert m("vllm:kvconnector_chunk_save_seconds_count") == saved
    assert m("vllm:kvconnector_load_batch_seconds_count") >= 2
    assert m("vllm:kvconnector_redis_fetch_seconds_count") >= 2
    # the lone Redis hit went layer by layer while its forward ran (load_by_layer)
    assert m("vllm:kvconnector_layer_loads_total") >= 1
    assert m("vllm:kvconnector_layer_wait_seconds_count") == m(
        "vllm:kvconnector_layer_loads_total")
    assert m("vllm:kvconnector_redis_chunks_total", op="get") >= 2
    assert m("vllm:kvconnector_redis_bytes_total", op="put") >= 8 * CHUNK_BYTES
    # The damaged values: counted by reason, deleted, recomputed.
    assert m("vllm:kvconnector_corrupt_values_total", reason="checksum") == 2
    assert m("vllm:kvconnector_load_errors_total", reason="not_in_slot") == 2
    # The memory tier: full, evicting.
    assert m("vllm:kvconnector_memory_slots") == 4
    assert m("vllm:kvconnector_memory_slots_used") == 4
    assert m("vllm:kvconnector_evictions_total") >= 6
    # The killed node: errors, a backoff, then a reconnect.
    assert m("vllm:kvconnector_redis_errors_total") >= 1
    assert m("vllm:kvconnector_redis_backoffs_total") >= 1
    assert m("vllm:kvconnector_redis_reconnects_total") >= 1
    assert metric(before, "vllm:kvconnector_redis_backoffs_total") == 0


def test_two_engines_serve_each_other_through_the_cluster(ops):
    a, b = ops["engines"]["a"], ops["engines"]["b"]
    assert [r["cached"] for r in (a[0][0], b[0][0], a[5][0], b[5][0])] == [0, 0, 0, 0]
    # Each engine loads the other's chunks and gets the tokens the other computed.
    assert a[4][0] == {"tokens": b[0][0]["tokens"], "cached": HIT}
    assert b[4][0] == {"tokens": a[0][0]["tokens"], "cached": HIT}
    assert a[10]["redis_loaded_chunks"] >= 2 and b[10]["redis_loaded_chunks"] >= 2
    assert a[10]["load_errors"] == 0 and b[10]["load_errors"] == 0


def test_a_node_killed_mid_run_costs_misses_only(ops):
    a, b = ops["engines"]["a"], ops["engines"]["b"]
    pb2, pa1 = a[9]
    assert pb2 == {"tokens": b[5][0]["tokens"], "cached": 0}  # its first chunk was there
    assert pa1 == {"tokens": a[0][0]["tokens"], "cached": HIT}  # memory still serves
    pa2, pb1 = b[9]
    assert pa2["tokens"] == a[5][0]["tokens"]
    assert pb1 == {"tokens": b[0][0]["tokens"], "cached": HIT}
    assert a[11]["errors"] + a[11]["timeouts"] >= 1 or a[11]["skipped_in_backoff"] >= 1


def test_engine_a_ran_on_its_lmcache_file(ops):
    a, b = ops["engines"]["a"], ops["engines"]["b"]
    # Its chunks share B's fingerprint (same keys), so the file's settings were applied.
    assert b[4][0]["cached"] == HIT
    assert a[11]["puts"] >= 4  # its redis_url came from the file's valkey:// cluster URL


def test_cli_stats_per_model_and_namespace(ops):
    rc, stats, _ = ops["cli"]["stats"]
    assert rc == 0 and stats["cluster"] and len(stats["nodes"]) == 3
    by_ns = {g["namespace"]: g for g in stats["fingerprints"]}
    assert set(by_ns) == {"served", ""}
    shared = by_ns[""]
    assert shared["fingerprint"] == ops["shared"]
    assert shared["chunks"] == 4 * STORED and shared["ranks"] == [0]  # PA1, PA2, PB1, PB2
    # Two full chunks and the first of a chunk's two blocks (only its bytes) per prompt.
    assert shared["bytes"] >= 4 * (2 * CHUNK_BYTES + CHUNK_BYTES // 2)
    assert shared["model"].endswith("tiny-mistral")
    assert shared["descriptor"]["chunk_nbytes"] == CHUNK_BYTES
    assert shared["newest_idle_s"] <= shared["oldest_idle_s"] < 600
    assert by_ns["served"]["chunks"] >= 2 and by_ns["served"]["model"] == shared["model"]
    assert ops["cli"]["stats_node_url"][1]["chunks"] == stats["chunks"]
    text = ops["cli"]["stats_text"]
    assert text.returncode == 0 and "tiny-mistral" in text.stdout and "served" in text.stdout
    assert "stats" in text.stderr  # the progress bar


def test_cli_verify_finds_reports_and_deletes_bad_values(ops):
    c = ops["cli"]
    rc, report, _ = c["verify"]
    assert rc == 1 and report["bad"] == 2
    assert {p["key"]: p["reason"] for p in report["problems"]} == c["damaged"]
    rc, mac, _ = c["verify_mac"]  # the engines sign nothing: every value fails a MAC check
    assert rc == 1 and mac["deleted"] == 0  # (the truncated one fails its length first)
    # ... and so does every fingerprint's descriptor, which a keyed verify never trusts
    assert mac["reasons"].pop("descriptor") >= 1
    assert mac["reasons"] == {"mac": mac["checked"] - 1, "truncated": 1}
    rc, deleted, _ = c["verify_delete"]
    assert rc == 1 and deleted["deleted"] == 2
    rc, again, _ = c["verify_again"]
    assert rc == 0 and again["bad"] == 0 and again["checked"] == report["checked"] - 2


def test_cli_purge_by_namespace(ops):
    c = ops["cli"]
    assert c["purge_unasked"].returncode == 2 and "--yes" in c["purge_unasked"].stderr
    rc, dry, _ = c["purge_dry"]
    assert rc == 0 and dry["deleted"] == 0 and dry["chunks"] >= 2
    rc, purged, _ = c["purge"]
    assert rc == 0 and purged["deleted"] == dry["chunks"] + 1  # and the descriptor
    rc, after, _ = c["stats_after_purge"]
    assert [g["namespace"] for g in after["fingerprints"]] == [""]
    assert after["chunks"] == 4 * STORED and after["other_keys"] == 1
    assert c["foreign_kept"] == (b"x", b"y")


def test_cli_on_a_single_server_never_prints_the_password(ops):
    c = ops["cli"]
    for name in ("single_url_password", "single_no_password", "single_wrong_password"):
        assert PASSWORD not in c[name].stdout + c[name].stderr, name
    assert c["single_url_password"].returncode == 0
    stats = json.loads(c["single_url_password"].stdout)
    assert stats["url"].startswith("redis://***@") and not stats["cluster"]
    assert stats["chunks"] == 4 * STORED
    assert c["single_env_password"][1]["chunks"] == 4 * STORED
    for name in ("single_no_password", "single_wrong_password"):
        assert c[name].returncode == 2 and "--password-env" in c[name].stderr, name
    rc, verify, _ = c["single_verify"]
    assert rc == 0 and verify["checked"] == 4 * STORED
    assert c["single_purge_all"][1]["deleted"] == 4 * STORED + 1  # and the descriptor
    assert c["single_after"][1]["chunks"] == 0 and c["single_after"][1]["other_keys"] == 1

