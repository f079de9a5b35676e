"""A small in-process broker for the client's security tests: ``serve_tcp`` with the real
TLS and authentication of ``pigeon.core`` in front of a service that answers lookups,
createProducer, send and subscribe minimally (every send is "stored" at once).

It runs in its own thread with its own trio loop, so the sync, asyncio and trio faces
all talk to it over loopback alike.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from pigeon.core.auth import Authenticator, TokenAuthenticationProvider
from pigeon.core.errors import AuthorizationError
from pigeon.core.rpc import BrokerFrame, Connection, Request, serve_tcp
from pigeon.core.testing import SecurityFiles
from pigeon.core.tls import ServerTls
from pigeon.core.tokens import create_secret_key, create_token


class FakeBroker:
    """Answers as the owner of every topic; ``allowed``: the roles that may produce
    and consume (None: everyone)."""

    def __init__(self) -> None:
        self.url = ""  # set once listening: pigeon[+ssl]://127.0.0.1:<port>
        self.allowed: set[str] | None = None
        self.connections: list[Connection] = []
        self.roles: list[str | None] = []  # the role of each connection, in order
        self.sent = 0

    def connection_opened(self, conn: Connection) -> None:
        self.connections.append(conn)
        self.roles.append(conn.role)

    def connection_closed(self, conn: Connection) -> None:
        pass

    def _check(self, conn: Connection, action: str) -> None:
        if self.allowed is not None and conn.role not in self.allowed:
            raise AuthorizationError(f"role {conn.role!r} may not {action}")

    def on_lookup(self, conn: Connection, req: Request) -> None:
        topic = str(req.body.topic)
        conn.respond(
            req.request_id,
            "lookupResult",
            {"brokerUrl": self.url, "partitions": 0, "topic": topic},
        )

    def on_createProducer(self, conn: Connection, req: Request) -> None:
        self._check(conn, "produce")
        conn.respond(
            req.request_id,
            "producerCreated",
            {
                "producerName": str(req.body.producerName) or "p",
                "lastSequenceId": -1,
                "maxMessageSize": 1 << 20,
                "topic": str(req.body.topic),
            },
        )

    def on_send(self, conn: Connection, req: Request) -> None:
        self.sent += 1
        b = req.body
        conn.respond(
            req.request_id,
            "sendReceipt",
            {
                "producerId": b.producerId,
                "sequenceId": b.sequenceId,
                "segmentId": 0,
                "entryId": self.sent,
                "firstOffset": self.sent,
            },
        )

    def on_closeProducer(self, conn: Connection, req: Request) -> None:
        conn.respond(req.request_id, "ok")

    def on_subscribe(self, conn: Connection, req: Request) -> None:
        self._check(conn, "consume")
        conn.respond(req.request_id, "subscribed", {})

    def on_flow(self, conn: Connection, req: Request) -> None:
        pass

    def on_closeConsumer(self, conn: Connection, req: Request) -> None:
        conn.respond(req.request_id, "ok")

    def drop_connections(self) -> None:
        """Close every connection (the clients re-attach); call on the broker's thread."""
        for conn in self.connections:
            conn.close()


def server_tls(
    certs: SecurityFiles, certificate: tuple[Path, Path] | None = None, **kwargs: Any
) -> ServerTls:
    """The broker's TLS with ``certs``' server certificate (or ``certificate``: a (cert,
    key) pair ``certs.issue`` wrote); ``kwargs``: more of ``ServerTls``."""
    cert, key = certificate or (certs.certificate_file, certs.key_file)
    return ServerTls(certificate_file=str(cert), key_file=str(key), **kwargs)


@dataclass
class Running:
    broker: FakeBroker
    url: str
    call: Callable[[Callable[[], Any]], Any]  # run a function on the broker's thread
    secret: bytes = b""

    def token(self, role: str) -> str:
        return create_token(role, self.secret)


@contextmanager
def fake_broker(
    *,
    tls: ServerTls | None = None,
    tokens: bool = False,
    secret: bytes | None = None,
    authenticator: Authenticator | None = None,
) -> Iterator[Running]:
    """Run a :class:`FakeBroker` (TLS with ``tls``; token authentication with ``tokens``,
    signed with ``secret`` or a new key, or this ``authenticator``) in a thread until the
    block ends."""
    broker = FakeBroker()
    secret = (secret or create_secret_key()) if tokens else b""
    if tokens:
        authenticator = Authenticator([TokenAuthenticationProvider(secret)])
    started: queue.Queue[Any] = queue.Queue()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(
                lambda task_status: serve_tcp(
                    broker,
                    BrokerFrame,
                    tls=tls,
                    authenticator=authenticator,
                    task_status=task_status,
                )
            )
            scheme = "pigeon+ssl" if tls is not None else "pigeon"
            broker.url = f"{scheme}://{host}:{port}"
            started.put((trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    token, scope = started.get(timeout=30)

    def call(fn: Callable[[], Any]) -> Any:
        return trio.from_thread.run_sync(fn, trio_token=token)

    try:
        yield Running(broker, broker.url, call, secret)
    finally:
        call(scope.cancel)
        thread.join(30)
