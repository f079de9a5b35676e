"""The RPC layer every PigeonMQ node speaks: framed Cap'n Proto over TCP, pipelined.

::

    conn, info = await connect_tcp(host, port, BrokerFrame, nursery)
    answer = await conn.request("lookup", {"topic": "t"})  # or request_nowait + callback

A server runs ``serve_tcp(service, BrokerFrame, port=6650)`` (started with
``nursery.start``, it reports its ``(host, port)``), where ``service`` has one synchronous
``on_<kind>(conn, req)`` method per request kind and answers with
``conn.respond(req.request_id, ...)``.  The frame layout is documented in
:mod:`pigeon.core._framing`, the connection's behaviour (bad input) in
:mod:`pigeon.core._connection`, the handshake in :mod:`pigeon.core._rpc`, and the messages
in ``pigeon/core/schema/protocol.capnp``.  Two services of one trio run (``pigeon
standalone``'s broker and bookie) talk over an in-process link instead of loopback TCP:
``stream = serve_local(service, BookieFrame, nursery)``, then ``conn, info = await
connect_local(stream, BookieFrame, nursery)`` (:class:`LocalStream`: frames, not bytes;
trusted, so no TLS and no authentication).  :func:`http_refusal` is the ``400`` answer a
protocol port (ours, or the Kafka listener) gives an HTTP client that reached it.
``with frame_batch():`` makes the frames a task sends in the block one write per
connection at its end (what a reader does for the frames its handlers send).
"""

from __future__ import annotations

from pigeon.core._connection import Connection, Request, frame_batch
from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE, http_refusal
from pigeon.core._local_link import LocalStream
from pigeon.core._rpc import (
    connect_local,
    connect_tcp,
    listen_error,
    listen_tcp,
    serve_local,
    serve_tcp,
    split_address,
)
from pigeon.core._schema import PROTOCOL_VERSION, BookieFrame, BrokerFrame

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "PROTOCOL_VERSION",
    "BookieFrame",
    "BrokerFrame",
    "Connection",
    "LocalStream",
    "Request",
    "connect_local",
    "connect_tcp",
    "frame_batch",
    "http_refusal",
    "listen_error",
    "listen_tcp",
    "serve_local",
    "serve_tcp",
    "split_address",
]
