"""The black-hole proxy: forwards, hangs (without closing) while cut, resumes when healed."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from ._proxy import ProxyHub


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def _echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_a_cut_link_hangs_and_heals(echo_port: int) -> None:
    with ProxyHub() as hub:
        proxy = hub.add("echo", echo_port)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            assert _echo(sock, b"before") == b"before"
            proxy.block()
            sock.settimeout(0.5)
            sock.sendall(b"during")
            with pytest.raises(TimeoutError):  # no answer, and no close either
                sock.recv(100)
            # a new connection is accepted but goes nowhere
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as late:
                late.settimeout(0.5)
                late.sendall(b"late")
                with pytest.raises(TimeoutError):
                    late.recv(100)
                proxy.heal()
                late.settimeout(5)
                assert late.recv(100) == b"late"
            sock.settimeout(5)
            assert sock.recv(100) == b"during"  # the same connection resumes
            assert _echo(sock, b"after") == b"after"
        stats = proxy.statistics()
        assert stats.connections == 2
        assert not stats.blocked


def test_a_dead_upstream_closes_the_client(echo_port: int) -> None:
    with ProxyHub() as hub:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]  # nothing listens there once closed
        proxy = hub.add("dead", dead)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            assert sock.recv(100) == b""
