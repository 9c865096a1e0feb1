"""The tests' own redis-server helper: a port another process took between picking it and
binding it must not hand the test that other server (CI once saw two cluster nodes on one
port: the second node's SET-CONFIG-EPOCH failed, and with it eight tests' setup)."""

from __future__ import annotations

import pytest

from tests.redis_server import PortTaken, RedisClusterServers, RedisServer


def _pid(server: RedisServer) -> int:
    with server.client() as c:
        return int(c.info("server")["process_id"])


def test_a_picked_port_that_is_taken_is_picked_again():
    with RedisServer() as other:
        server = RedisServer()
        server.port = other.port  # as if ``other`` had bound it after the pick
        with server:
            assert server.port != other.port
            assert _pid(server) == server.proc.pid
            assert _pid(other) == other.proc.pid


def test_a_given_port_that_is_taken_is_an_error():
    with RedisServer() as other:
        server = RedisServer(port=other.port, startup_timeout_s=5)
        with pytest.raises(PortTaken, match=str(other.port)):
            server.start()
        server.stop()
        assert _pid(other) == other.proc.pid  # the other server is left alone


def test_two_cluster_nodes_given_one_port_still_make_a_cluster():
    cluster = RedisClusterServers(3)
    cluster.nodes[2].port = cluster.nodes[0].port
    with cluster:
        ports = [node.port for node in cluster.nodes]
        assert len(set(ports)) == 3, ports
        for node in cluster.nodes:
            assert _pid(node) == node.proc.pid
            with node.client() as c:
                assert c.execute_command("CLUSTER", "INFO").decode().count(
                    "cluster_state:ok") == 1
