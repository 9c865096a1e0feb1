"""The Redis store's state is read by one thread (the scheduler's stats) while others change
it (the lookup and put threads): reading must never fail."""

from __future__ import annotations

import socket
import sys
import threading

from kvconnector.store.redis_connections import RedisConnections, connected_to_itself


def test_backoff_state_can_be_read_while_cluster_nodes_are_added():
    conns = RedisConnections(
        "redis://127.0.0.1:1", "redis://127.0.0.1:1", cluster=True, timeout_s=0.1,
        connect_timeout_s=None, max_connections=1, backoff_initial_s=0.5, backoff_max_s=1.0,
        lookup_timeout_streak=3, seed=0, count=lambda **_: None, redis_kwargs={})
    stop = threading.Event()

    def add_nodes() -> None:  # what the lookup thread does on first contact with a node
        n = 0
        while not stop.is_set():
            conns._node_backoffs.setdefault(f"node{n}", conns._new_backoff())
            n += 1
            if n % 64 == 0:
                conns._node_backoffs.clear()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    writer = threading.Thread(target=add_nodes)
    writer.start()
    try:
        for _ in range(20_000):
            assert conns.in_backoff is False
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(interval)


def test_a_connection_to_its_own_port_is_recognised():
    """A reconnect to a port with no server can connect to itself and hold the port the
    server restarts on (seen once in CI: "Address already in use" on a restart)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())  # a simultaneous open with itself
        assert connected_to_itself(s)
    finally:
        s.close()
    with socket.create_server(("127.0.0.1", 0)) as server:
        c = socket.create_connection(server.getsockname())
        try:
            assert not connected_to_itself(c)
        finally:
            c.close()
    assert not connected_to_itself(None)
