"""ops.redis_server.free_ports: ports for several processes at once are distinct and free."""

from __future__ import annotations

import socket

from ops.redis_server import free_port, free_ports


def test_ports_chosen_together_are_distinct_and_each_can_be_bound() -> None:
    for _ in range(20):  # free_port() twice in a row returned the same port once; these never may
        ports = free_ports(6)
        assert len(set(ports)) == 6
    held = []
    try:
        for port in ports:  # nothing holds them after the call
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
    assert 0 < free_port() < 65536
