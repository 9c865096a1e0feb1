"""A store's connections to Redis (or to each node of a Redis Cluster), and the calls made
on them.

* every call is one pipeline: all commands are written, then all replies read (in a
  cluster, to all nodes concerned at once), so one call costs one round trip;
* the connections are kept between calls (checked with a poll when idle for more than
  50 ms), skipping redis-py's per-checkout checks;
* faults are counted, never raised: a connection error (and a timeout of a put or a get,
  or the third lookup in a row over its budget) puts the server in backoff
  (``redis_backoff``); a cluster's nodes back off one by one.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import random
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvconnector.store.redis_backoff import Backoff
from kvconnector.store.redis_call import Call, Group, Held
from kvconnector.store.redis_wire import Timeout, Wire, gather

logger = logging.getLogger("kvconnector.store.redis")

# A connection idle for longer is polled before reuse, to find one the server closed
# (restart, idle timeout) without losing a call; one used just before is trusted.
_RECHECK_AFTER_S = 0.05
# No CLIENT SETINFO on connect: one round trip less, and none to wait for on a hung server.
_NO_CLIENT_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.connection.AbstractConnection).parameters
    else {"lib_name": None, "lib_version": None})


def connected_to_itself(sock: socket.socket | None) -> bool:
    """A TCP connect to a local port no server listens on can be given that very port as
    its own and connect to itself (a simultaneous open): it then holds the port the
    server would restart on, and answers each command with the command."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        return sock.getsockname() == sock.getpeername()
    except OSError:
        return False


class RedisConnections:
    """The connections of one ``RedisStore``: which server each key lives on, a connection
    to it per call (at most ``max_connections`` calls at once), and the backoff of each
    server. Thread-safe. ``count`` adds to the store's counters (``RedisStoreStats``)."""

    def __init__(self, url: str, safe_url: str, *, cluster: bool, timeout_s: float,
                 connect_timeout_s: float | None, max_connections: int,
                 backoff_initial_s: float, backoff_max_s: float, lookup_timeout_streak: int,
                 seed: int | None, count: Callable[..., None],
                 redis_kwargs: dict[str, Any]) -> None:
        self.url = url
        self.safe_url = safe_url
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.lookup_timeout_streak = lookup_timeout_streak
        self._count = count
        self._lock = threading.Lock()
        self._slots: queue.SimpleQueue = queue.SimpleQueue()  # one token per connection
        for _ in range(max_connections):
            self._slots.put(None)
        self._backoff_s = (backoff_initial_s, backoff_max_s)
        self._rng = random.Random(seed)
        self._backoff = self._new_backoff()  # the server's, or a cluster's routing
        self._node_backoffs: dict[str, Backoff] = {}  # a cluster's, per node
        self._timeout_streak = 0
        self._closed = False
        # Connections held between calls, per pool: reused without the pool's
        # per-checkout checks (tens of microseconds, a good part of a 64 KiB GET).
        self._idle: dict[int, tuple[Any, list[Held]]] = {}
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (s := ref()) is not None and s._forget_idle())
        self._conn_kwargs: dict[str, Any] = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s if connect_timeout_s else min(
                timeout_s, 0.5),
            protocol=2, **_NO_CLIENT_SETINFO,
            retry=Retry(NoBackoff(), 0), max_connections=max_connections,
            health_check_interval=0)
        self._conn_kwargs.update(redis_kwargs)
        self.pool: redis.ConnectionPool | None = None  # a single server's
        self._cluster: Any = None  # redis.cluster.RedisCluster, made on first use
        self._cluster_stale = False
        self._cluster_lock = threading.Lock()
        if not cluster:
            # Parses the URL (password, db, TLS, unix socket); connects on first use.
            try:
                self.pool = redis.ConnectionPool.from_url(url, **self._conn_kwargs)
            except ValueError as e:  # its message may quote the URL's parts: not shown
                raise ValueError(f"bad Redis URL {self.safe_url!r} ({type(e).__name__})") \
                    from None
            self.pool.connection_kwargs["protocol"] = 2  # the wire code speaks RESP2

    def _new_backoff(self) -> Backoff:
        return Backoff(*self._backoff_s, self._rng)

    @property
    def in_backoff(self) -> bool:
        """The server, or any node of the cluster, is backing off."""
        # A copy: the lookup and put threads add nodes while the stats read this.
        nodes = tuple(self._node_backoffs.values())
        return self._backoff.active or any(b.active for b in nodes)

    def note_error_replies(self, errors: list[str]) -> None:
        """Error replies to a call: a cluster's MOVED, ASK or CLUSTERDOWN has its slot map
        reloaded before the next call."""
        if self.cluster and any(e.startswith(("MOVED", "ASK", "CLUSTERDOWN")) for e in errors):
            self._cluster_stale = True

    def new_client(self) -> redis.Redis:
        """A client of the single server with these connections' settings (URL, password,
        TLS, timeouts), outside their pool and its call slots."""
        if self.pool is None:
            raise ValueError("a Redis Cluster has no single server")
        kwargs = dict(self._conn_kwargs, max_connections=2)
        return redis.Redis(connection_pool=redis.ConnectionPool.from_url(self.url, **kwargs))

    def close(self) -> None:
        self._closed = True
        self._drain_idle()
        try:
            if self.pool is not None:
                self.pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
        except Exception as e:  # closing must not raise either
            logger.debug("closing %s: %s", self.safe_url, e)

    def _routes(self, rkeys: list[bytes]) -> list[tuple[Any, Sequence[int], Backoff, str]]:
        """(connection pool, key indices, its backoff, its name) per server the keys live
        on. A cluster's nodes back off one by one: the keys of live nodes keep being
        served while a dead one is skipped."""
        if not self.cluster:
            return [(self.pool, range(len(rkeys)), self._backoff, self.safe_url)]
        with self._cluster_lock:
            if self._cluster is None:
                from redis.cluster import RedisCluster
                kw = {k: v for k, v in self._conn_kwargs.items() if k != "retry"}
                self._cluster = RedisCluster.from_url(
                    self.url, retry=Retry(NoBackoff(), 0), **kw)
                self._cluster_stale = False
            elif self._cluster_stale:
                self._drain_idle()  # nodes may have moved: pools are rebuilt
                self._cluster.nodes_manager.initialize()
                self._cluster_stale = False
            rc = self._cluster
        groups: dict[str, tuple[Any, list[int], Backoff, str]] = {}
        for i, k in enumerate(rkeys):
            node = rc.get_node_from_key(k)
            group = groups.get(node.name)
            if group is None:
                backoff = self._node_backoffs.get(node.name)
                if backoff is None:
                    backoff = self._node_backoffs.setdefault(node.name, self._new_backoff())
                group = groups[node.name] = (node.redis_connection.connection_pool, [],
                                             backoff, node.name)
            group[1].append(i)
        return list(groups.values())

    def call(self, op: str, rkeys: list[bytes], cmds: list[Any],
             read: Callable[[Wire, int], None], deadline: float | None,
             window: int | None = None) -> list[bool]:
        """Run one pipeline: send ``cmds[i]`` (packed bytes, or (head, payload, tail) to be
        written without copying the payload) for every key, then ``read`` every reply.
        With ``window``, at most that many commands per server are unanswered at a time
        (large replies: ``RedisStore.get_many``).
        Returns, per key, whether its server answered: False for a key whose server is in
        backoff or failed (its ``read`` results are to be ignored). Faults are counted,
        never raised; each server (each node of a cluster) backs off on its own."""
        return self.begin(op, rkeys, cmds, read, deadline, window).finish()

    def begin(self, op: str, rkeys: list[bytes], cmds: list[Any],
              read: Callable[[Wire, int], None], deadline: float | None,
              window: int | None = None) -> Call:
        """``call`` with its replies left to ``Call.finish``."""
        begun = self._begin(op, rkeys, cmds, read, deadline, window, at_once=False)
        assert begun is not None  # only a call begun at once gives up before sending
        return begun

    def start(self, op: str, rkeys: list[bytes], cmds: list[Any],
              read: Callable[[Wire, int], None], deadline: float) -> Call | None:
        """``call`` begun on a thread that must not wait: the commands sent on a connection
        already open, their replies left to ``Call.finish`` (on any thread). None, with
        nothing sent, where beginning could wait or connect: a cluster, a server backing
        off (its probe may connect), no idle connection, no free call slot."""
        if self.cluster or self._backoff.active:
            return None
        return self._begin(op, rkeys, cmds, read, deadline, None, at_once=True)

    def _begin(self, op: str, rkeys: list[bytes], cmds: list[Any],
               read: Callable[[Wire, int], None], deadline: float | None,
               window: int | None, at_once: bool) -> Call | None:
        begun = Call(self, op, rkeys, cmds, read, deadline, window)
        if self._closed:
            return begun
        state = self._backoff.allow()  # the server, or a cluster's routing
        if state == "skip":
            self._count(skipped_in_backoff=1)
            return begun
        if state == "probe":
            self._count(reconnects=1)
            at_once = False  # a probe is carried through, connect or not
        try:
            self._slots.get_nowait()
        except queue.Empty:
            wait = self.timeout_s if deadline is None else deadline - time.monotonic()
            try:
                if wait <= 0 or at_once:
                    raise queue.Empty
                self._slots.get(timeout=wait)
            except queue.Empty:
                if at_once:
                    return None
                self._count(busy=1)
                if state == "probe":
                    self._backoff.failure(probe=True)
                return begun
        begun.slot = True
        try:
            routes = self._routes(rkeys)
        except Exception as e:
            self._failure(op, state, e, self._backoff, self.safe_url)
            begun.release()
            return begun
        if self.cluster and state == "probe":
            self._backoff.success()  # the cluster answers again; its nodes decide
            state = "ok"
        groups = begun.groups
        for pool, idx, backoff, name in routes:
            g_state = state if backoff is self._backoff else backoff.allow()
            if g_state == "skip":
                self._count(skipped_in_backoff=1)
                continue
            if g_state == "probe" and backoff is not self._backoff:
                self._count(reconnects=1)
            groups.append(Group(pool, idx, backoff, name, g_state))
        if at_once:
            for g in groups:
                g.held = self._acquire(g.pool, connect=False)
            if any(g.held is None for g in groups):
                begun.release()
                return None
        for g in groups:
            if g.held is None:
                g.attempt(lambda g=g: setattr(g, "held", self._acquire(g.pool)))
        if deadline is not None and time.monotonic() >= deadline:
            for g in groups:
                g.fail(Timeout("over the time budget while connecting"))
        for g in groups:
            if g.held is not None:
                g.held.wire.deadline = deadline
            first = g.idx if window is None else g.idx[:window]
            g.attempt(lambda g=g, first=first: g.held.wire.send(gather(cmds, first)))
        return begun

    def _settle(self, begun: Call) -> list[bool]:
        """A call's replies read: counted, and each server's backoff told."""
        answered = [False] * len(begun.rkeys)
        for g in begun.groups:
            if g.error is not None:
                self._failure(begun.op, g.state, g.error, g.backoff, g.name)
                continue
            for i in g.idx:
                answered[i] = True
            with self._lock:
                self._timeout_streak = 0
            if g.state == "probe":
                g.backoff.success()
                logger.info("kvconnector redis %s: reachable again", g.name)
        return answered

    def _acquire(self, pool: Any, connect: bool = True) -> Held | None:
        """A connected connection: the last one this store used with ``pool`` if a poll
        shows nothing unread on it (a server that closed it makes it readable), else one
        from the pool (which connects it), or None where that needs ``connect``."""
        entry = self._idle.get(id(pool))
        while entry and entry[1]:
            try:
                held = entry[1].pop()
            except IndexError:
                break
            wire = held.wire
            if held.conn._sock is wire.sock and wire.start == wire.end and (
                    time.monotonic() - held.used < _RECHECK_AFTER_S
                    or not held.poller.poll(0) and not (
                        isinstance(wire.sock, ssl.SSLSocket) and wire.sock.pending())):
                return held
            held.conn.disconnect()  # closed by the server (restart, idle timeout)
            pool.release(held.conn)
        if not connect:
            return None
        conn = pool.get_connection()
        if connected_to_itself(conn._sock):
            conn.disconnect()
            pool.release(conn)
            raise redis.ConnectionError("no server: the connection reached its own port")
        poller = select.poll()
        poller.register(conn._sock, select.POLLIN)
        return Held(pool, conn, poller, Wire(conn._sock, None), 0.0)

    def _release(self, held: Held, failed: bool, restore_timeout: bool) -> None:
        conn = held.conn
        try:
            if failed or conn._sock is None:
                conn.disconnect()
                held.pool.release(conn)
                return
            if restore_timeout:
                conn._sock.settimeout(self._conn_kwargs["socket_timeout"])
            held.used = time.monotonic()
            entry = self._idle.get(id(held.pool))
            if entry is None:
                entry = self._idle.setdefault(id(held.pool), (held.pool, []))
            entry[1].append(held)
        except Exception as e:
            logger.debug("releasing a connection: %s", e)

    def _drain_idle(self) -> None:
        for pool, idle in list(self._idle.values()):
            while idle:
                try:
                    held = idle.pop()
                except IndexError:
                    break
                try:
                    held.conn.disconnect()
                    pool.release(held.conn)
                except Exception:
                    pass

    def _forget_idle(self) -> None:
        """In a forked child: the parent's sockets are not ours to use, nor to close."""
        self._idle = {}

    def _failure(self, op: str, state: str, e: BaseException, backoff: Backoff,
                 where: str) -> None:
        is_timeout = isinstance(e, (socket.timeout, TimeoutError, redis.TimeoutError))
        with self._lock:
            if is_timeout:
                self._timeout_streak += 1
                streak = self._timeout_streak
            else:
                streak = 0
        if is_timeout:
            self._count(timeouts=1)
        else:
            self._count(errors=1)
        if is_timeout and op == "exists" and state != "probe" and \
                streak < self.lookup_timeout_streak:
            logger.debug("kvconnector redis %s: lookup over its budget", where)
            return
        delay = backoff.failure(probe=state == "probe")
        if self.cluster:
            self._cluster_stale = True
        if delay is None:
            return
        self._count(backoffs=1)
        self._drain_idle()
        log = logger.warning if state == "ok" else logger.debug
        log("kvconnector redis %s: %s failed (%s: %s); misses for %.2fs", where, op,
            type(e).__name__, e, delay)
