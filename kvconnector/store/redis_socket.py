"""A Redis on this host, named by a TCP URL, reached over its unix socket when it has one.

In the engine on the 2-core machine of docs/benchmarks.md (section 15) a 45 MiB hit's fetch
took 0.6 of its TCP time over the socket, where vLLM's engine core spins on the other core.
The socket is the one the server itself reports (``CONFIG GET unixsocket``), used only if
it is a socket file here whose listening process is the server's own (``process_id`` over
TCP against the kernel's peer credentials of the socket, Linux), checked before anything is
sent to it. Anything else, or any fault, keeps TCP.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import struct
from typing import Any

import redis

logger = logging.getLogger("kvconnector.store.redis")

# Connection settings that only a TCP connection takes.
_TCP_ONLY = ("host", "port", "socket_keepalive", "socket_keepalive_options", "socket_type")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _info_field(conn: Any, name: bytes) -> bytes | None:
    conn.send_command("INFO", "server")
    for line in bytes(conn.read_response()).splitlines():
        if line.startswith(name + b":"):
            return line[len(name) + 1:].strip()
    return None


def _listener_pid(path: str, timeout_s: float) -> int | None:
    """The process listening on unix socket ``path`` (its kernel-given credentials; nothing
    is sent to it), or None where the platform does not tell."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        pid, _uid, _gid = struct.unpack(
            "3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def socket_path(pool: redis.ConnectionPool, timeout_s: float) -> str | None:
    """The unix socket of the same server as ``pool``'s TCP URL, if it is on this host and
    has one this process can reach; else None (and nothing but the TCP URL was asked)."""
    kw = pool.connection_kwargs
    if pool.connection_class is not redis.Connection or not _loopback(str(kw.get("host"))):
        return None  # remote, TLS or already a socket
    tcp = redis.Connection(**{**kw, "socket_timeout": timeout_s,
                              "socket_connect_timeout": timeout_s})
    try:
        tcp.send_command("CONFIG", "GET", "unixsocket")
        reply = tcp.read_response()
        path = os.fsdecode(reply[1]) if isinstance(reply, list) and len(reply) == 2 else ""
        if not path or not os.path.isabs(path) or not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
        pid = _info_field(tcp, b"process_id")
        # The same process behind both, by the kernel's word, before any credentials go to
        # the socket (another PID namespace, or another server on that path: TCP stays).
        if pid is None or _listener_pid(path, timeout_s) != int(pid):
            return None
        return path
    except (redis.RedisError, OSError, ValueError, TypeError) as e:
        logger.debug("kvconnector: no unix socket for the Redis on this host: %r", e)
        return None
    finally:
        tcp.disconnect()


def socket_pool(pool: redis.ConnectionPool, path: str) -> redis.ConnectionPool:
    """``pool`` with its connections made over ``path`` instead (same database, user,
    password, timeouts and limits)."""
    kw = {k: v for k, v in pool.connection_kwargs.items() if k not in _TCP_ONLY}
    return redis.ConnectionPool(connection_class=redis.UnixDomainSocketConnection,
                                path=path, max_connections=pool.max_connections, **kw)
