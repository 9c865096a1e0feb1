"""A TCP URL of a Redis on this host goes over the server's own unix socket
(``store/redis_socket.py``), only when that socket is the same server; real redis-servers."""

from __future__ import annotations

import os
import time

import redis
from redis_server import RedisServer

from kvconnector.store.redis_socket import socket_path
from kvconnector.store.redis_store import RedisStore


def _over_socket(store: RedisStore) -> bool:
    return store._connections.pool.connection_class is redis.UnixDomainSocketConnection


def _round_trip(writer: RedisStore, reader: RedisStore) -> bool:
    value = os.urandom(1 << 16)
    client = redis.Redis(connection_pool=writer._connections.pool)
    client.set(b"kvc:socket-test", value)
    return redis.Redis(connection_pool=reader._connections.pool).get(b"kvc:socket-test") == value


def test_a_local_tcp_url_goes_over_the_servers_socket():
    with RedisServer(unixsocket=True) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        auto = RedisStore(url, prefer_socket=True)
        tcp = RedisStore(url, prefer_socket=False)
        assert _over_socket(auto) and not _over_socket(tcp)
        assert auto._connections.pool.connection_kwargs["path"] == server.unix_path
        assert _round_trip(tcp, auto) and _round_trip(auto, tcp)
        auto.close()
        tcp.close()


def test_the_password_and_database_go_with_it():
    with RedisServer(unixsocket=True, password="s3cret-pw") as server:
        url = server.url + "/3"
        auto = RedisStore(url, prefer_socket=True)
        assert _over_socket(auto)
        assert auto._connections.pool.connection_kwargs["db"] == 3
        assert _round_trip(RedisStore(url), auto)
        assert server.client(db=3).exists(b"kvc:socket-test")
        auto.close()


def test_no_socket_a_refusing_server_or_a_remote_host_keep_tcp():
    with RedisServer() as server:  # no unix socket
        assert not _over_socket(RedisStore(server.url, prefer_socket=True))
    with RedisServer(unixsocket=True, extra_args=["--rename-command", "CONFIG", ""]) as server:
        assert not _over_socket(RedisStore(server.url, prefer_socket=True))
    down = RedisServer(unixsocket=True).start()
    url = down.url
    down.stop()
    assert not _over_socket(RedisStore(url, prefer_socket=True))  # a miss later, not now
    start = time.monotonic()
    remote = RedisStore("redis://192.0.2.1:6379", prefer_socket=True)  # TEST-NET: unroutable
    assert not _over_socket(remote) and time.monotonic() - start < 0.1  # nothing was asked


def test_a_socket_of_another_server_is_not_used():
    """The server reports a socket path that another server has since taken over: another
    process listens there, so the first server stays on TCP."""
    with RedisServer(unixsocket=True) as first:
        os.unlink(first.unix_path)
        other = RedisServer(unixsocket=True)
        other.unix_path = first.unix_path  # binds the path the first one still reports
        with other:
            assert other.client(unix_socket_path=first.unix_path).ping()
            pool = redis.ConnectionPool.from_url(first.url)
            assert socket_path(pool, 0.2) is None
            assert not _over_socket(RedisStore(first.url, prefer_socket=True))


def test_nothing_is_sent_to_a_socket_another_process_listens_on():
    """The server's reported path is served by a process that is not the server (a plain
    listener standing in for any other local service): it is never used, and it receives
    not a byte, so no password reaches it."""
    import socket
    import threading

    with RedisServer(unixsocket=True, password="s3cret-pw") as server:
        os.unlink(server.unix_path)
        received: list[bytes] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(server.unix_path)
            listener.listen()

            def serve() -> None:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(1.0)
                    try:
                        while data := conn.recv(4096):
                            received.append(data)
                    except OSError:
                        pass

            thread = threading.Thread(target=serve, daemon=True)
            thread.start()
            store = RedisStore(server.url, prefer_socket=True)
            assert not _over_socket(store)
            thread.join(5)
        assert received == []
        assert _round_trip(store, RedisStore(server.url))  # still served, over TCP
