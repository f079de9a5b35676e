"""PigeonMQ's small RPC layer on trio.

pycapnp's own RPC needs asyncio, so nodes talk through this instead:

* one :class:`~pigeon.core._connection.Connection` per TCP stream (its reader and writer
  tasks, handlers and bad input are described in :mod:`pigeon.core._connection`);
* request ids, so that many requests are in flight per connection (pipelining);
* answers are either the expected struct or an ``error`` carrying a typed
  :mod:`pigeon.core.errors` code;
* server pushes (``requestId`` 0) go to the connection's handler;
* a ``connect`` handshake that checks the protocol version and that both ends speak the
  same root struct (a client of a broker that dialled a bookie's port is told so), and
  carries the client's credentials to the server's :class:`~pigeon.core.auth.Authenticator`
  (the role it establishes is ``conn.role``): :func:`connect_tcp` on the dialling side,
  :func:`serve_tcp` on the accepting side;
* TLS (:mod:`pigeon.core.tls`) under all of it when both sides are given a context: a
  plaintext client on a TLS port is answered, in plaintext, that the port takes TLS;
* an in-process link (:mod:`pigeon.core._local_link`) between two services of one trio
  run (``pigeon standalone``'s broker and its bookie): :func:`serve_local` on the serving
  side, :func:`connect_local` on the dialling side; the same handshake and answers, no
  socket, no TLS, and no authentication (the link is trusted: ``conn.in_process``).
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from pigeon.core._connection import Connection, Request
from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE
from pigeon.core._local_link import LocalStream, local_stream_pair
from pigeon.core._memnet import active_network
from pigeon.core._schema import PROTOCOL_VERSION, frame_name, frame_role
from pigeon.core.auth import AuthData, Authenticator, ClientAuthentication
from pigeon.core.errors import (
    AuthenticationError,
    ConfigError,
    ConnectionClosed,
    PigeonError,
    ProtocolError,
    ProtocolVersionMismatch,
    Timeout,
    TlsError,
)
from pigeon.core.tls import ServerTls, accept_tls, connect_tls

__all__ = [
    "connect_local",
    "connect_tcp",
    "listen_error",
    "listen_tcp",
    "serve_local",
    "serve_tcp",
    "split_address",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------- handshake


def _connected_extract(body: Any, payload: memoryview) -> dict[str, Any]:
    return {
        "protocolVersion": body.protocolVersion,
        "serverName": body.serverName,
        "maxFrameSize": body.maxFrameSize,
        "maxMessageSize": body.maxMessageSize,
        "features": list(body.features),
        "frameType": str(body.frameType),
        "authRole": str(body.authRole),
    }


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (``[v6]:port`` too; no host: loopback)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def connect_tcp(
    host: str,
    port: int,
    frame_type: Any,
    nursery: trio.Nursery,
    *,
    handler: Any = None,
    client_name: str = "pigeon",
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    protocol_version: int = PROTOCOL_VERSION,
    connect_timeout: float = 10.0,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    authentication: ClientAuthentication | None = None,
) -> tuple[Connection, dict[str, Any]]:
    """Open a connection, start it in ``nursery`` and do the ``connect`` handshake.

    ``tls``: run TLS with this context first (:func:`pigeon.core.tls.client_context`),
    verifying the certificate against ``server_hostname`` (default ``host``).
    ``authentication``: credentials presented in the handshake (asked for afresh).

    Raises :class:`ConnectionClosed` when nothing listens, :class:`ProtocolError` when the
    port speaks another protocol (a bookie's port for a broker client, an HTTP port that
    answered), :class:`TlsError` when the TLS handshake is refused,
    :class:`AuthenticationError` when the server does not accept the credentials,
    :class:`Timeout` when the port accepted but never answered the handshake.
    """
    network = active_network()
    try:
        with trio.fail_after(connect_timeout):
            if network is not None:
                stream: trio.abc.Stream = await network.connect(host, port)
            else:
                stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError) as exc:
        raise ConnectionClosed(f"cannot connect to {host}:{port}: {exc}") from None
    probe: Callable[[], Awaitable[str | None]] | None = None
    if tls is not None:
        stream = await connect_tls(
            stream,
            tls,
            server_hostname or host,
            handshake_timeout=connect_timeout,
            address=f"{host}:{port}",
        )
    else:

        async def probe() -> str | None:
            async def open_stream() -> trio.abc.Stream:
                if network is not None:
                    return await network.connect(host, port)
                return await trio.open_tcp_stream(host, port)

            return await probe_port(open_stream, host, port, frame_role(frame_type))

    return await _handshake(
        stream,
        frame_type,
        nursery,
        f"{host}:{port}",
        probe=probe,
        handler=handler,
        client_name=client_name,
        max_frame_size=max_frame_size,
        protocol_version=protocol_version,
        connect_timeout=connect_timeout,
        authentication=authentication,
    )


async def connect_local(
    stream: LocalStream,
    frame_type: Any,
    nursery: trio.Nursery,
    *,
    name: str = "in-process",
    handler: Any = None,
    client_name: str = "pigeon",
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    protocol_version: int = PROTOCOL_VERSION,
    connect_timeout: float = 10.0,
) -> tuple[Connection, dict[str, Any]]:
    """:func:`connect_tcp` over the client end of an in-process link (what
    :func:`serve_local` returned): the same handshake and errors, no credentials (the
    serving side trusts the link).  ``name``: the connection's name in logs."""
    return await _handshake(
        stream,
        frame_type,
        nursery,
        name,
        handler=handler,
        client_name=client_name,
        max_frame_size=max_frame_size,
        protocol_version=protocol_version,
        connect_timeout=connect_timeout,
        authentication=None,
    )


async def _handshake(
    stream: trio.abc.Stream,
    frame_type: Any,
    nursery: trio.Nursery,
    address: str,
    *,
    handler: Any,
    client_name: str,
    max_frame_size: int,
    protocol_version: int,
    connect_timeout: float,
    authentication: ClientAuthentication | None,
    probe: Callable[[], Awaitable[str | None]] | None = None,
) -> tuple[Connection, dict[str, Any]]:
    """Start a connection over an open ``stream`` and say ``connect`` (see
    :func:`connect_tcp`).  ``probe``: asked after :data:`HTTP_PROBE_AFTER_S` of silence,
    or when the peer closes the connection instead of answering, what the port is
    (:func:`probe_port`); a text fails the handshake with it at once."""
    auth_method = auth_data = None
    if authentication is not None:
        auth_method = authentication.auth_method
        try:
            auth_data = authentication.auth_data()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    conn = Connection(
        stream, frame_type, handler=handler, max_frame_size=max_frame_size, name=address
    )
    await nursery.start(conn.run)
    ours = frame_name(frame_type)
    try:
        try:
            with trio.fail_after(connect_timeout):
                request = conn.request(
                    "connect",
                    {
                        "protocolVersion": protocol_version,
                        "clientName": client_name,
                        "frameType": ours,
                        "authMethod": auth_method or "",
                        "authData": auth_data or b"",
                    },
                    expect="connected",
                    extract=_connected_extract,
                )
                info = await _answer_or_probe(request, probe)
        except trio.TooSlowError:
            raise Timeout(
                f"{address} accepted the connection but did not answer the PigeonMQ"
                f" handshake within {connect_timeout}s: is it a PigeonMQ"
                f" {frame_role(frame_type)} port (not an HTTP or admin port)?"
            ) from None
        except (ProtocolError, AuthenticationError) as exc:  # refused: say which server
            raise type(exc)(f"{address}: {exc.message}") from None
        theirs = info["frameType"]
        if theirs and theirs != ours:
            raise ProtocolError(_wrong_service(address, server=theirs, client=ours))
    except BaseException:
        conn.close()
        raise
    conn.peer_name = info["serverName"]
    conn.peer_version = info["protocolVersion"]
    conn.role = info["authRole"] or None
    return conn, info


#: how long a new plaintext connection may stay silent after ``connect`` before the client
#: asks the port, on a second connection, whether it is an HTTP server
#: (:func:`probe_http`): a PigeonMQ node answers ``connect`` in milliseconds, an HTTP
#: server waits for a request line and never answers
HTTP_PROBE_AFTER_S = 1.0
#: how long the probe waits for the HTTP answer
HTTP_PROBE_TIMEOUT_S = 2.0


async def _answer_or_probe(
    request: Awaitable[dict[str, Any]], probe: Callable[[], Awaitable[str | None]] | None
) -> dict[str, Any]:
    """``await request``; if it has not answered after :data:`HTTP_PROBE_AFTER_S`, or
    the peer closed the connection without an answer (a Kafka broker closes on a request
    size it refuses), and ``probe`` says what else the port is, a ProtocolError with its
    text at once."""
    if probe is None:
        return await request
    found: list[str] = []
    answer: list[dict[str, Any]] = []
    failure: list[Exception] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            await trio.sleep(HTTP_PROBE_AFTER_S)
            text = await probe()
            if text is not None:
                found.append(text)
                nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            answer.append(await request)
        except Exception as exc:  # re-raised below, not wrapped in an exception group
            failure.append(exc)
        nursery.cancel_scope.cancel()
    if not found and failure and isinstance(failure[0], ConnectionClosed):
        text = await probe()
        if text is not None:
            found.append(text)
    if found:
        raise ProtocolError(found[0])
    if failure:
        raise failure[0]
    return answer[0]


async def probe_port(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str, port: int, role: str
) -> str | None:
    """What ``host:port`` is, if it is not a PigeonMQ ``role`` port: asked over HTTP
    (:func:`probe_http`) and as a Kafka broker (:func:`probe_kafka`) at once, on two new
    connections; the first verdict wins (None: neither answered as such)."""
    found: list[str] = []
    async with trio.open_nursery() as nursery:

        async def ask(probe: Callable[..., Awaitable[str | None]]) -> None:
            text = await probe(open_stream, host, port, role)
            if text is not None and not found:
                found.append(text)
                nursery.cancel_scope.cancel()

        nursery.start_soon(ask, probe_http)
        nursery.start_soon(ask, probe_kafka)
    return found[0] if found else None


async def _exchange(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]],
    request: bytes,
    enough: Callable[[bytes], bool],
) -> bytes:
    """Send ``request`` on a new connection and read what comes back until the peer
    closes, ``enough(data)`` holds, 64 KiB, or :data:`HTTP_PROBE_TIMEOUT_S`."""
    data = b""
    with trio.move_on_after(HTTP_PROBE_TIMEOUT_S):
        try:
            stream = await open_stream()
        except OSError:
            return data
        try:
            await stream.send_all(request)
            while len(data) < 65536 and not enough(data):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)
    return data


_HTTP_PROBE_PATH = "/admin/v2/cluster/health"


async def probe_http(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str, port: int, role: str
) -> str | None:
    """Ask ``host:port`` (a second connection from ``open_stream``) ``GET
    /admin/v2/cluster/health`` and say what it is: a PigeonMQ broker's admin HTTP port
    (its answer names the service URL to use instead), another HTTP server, or ``None``
    (no HTTP answer within :data:`HTTP_PROBE_TIMEOUT_S`, or a PigeonMQ protocol port that
    refused the request: a slow node, not a wrong port)."""
    request = (
        f"GET {_HTTP_PROBE_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Accept: application/json\r\nConnection: close\r\n\r\n"
    )
    data = await _exchange(open_stream, request.encode(), lambda _: False)
    return describe_http_answer(data, port, role)


def describe_http_answer(data: bytes, port: int, role: str) -> str | None:
    """What :func:`probe_http` says of the bytes ``data`` port ``port`` answered (a pure
    function: the HTTP status line, then, for a PigeonMQ admin port, the JSON of
    ``/admin/v2/cluster/health`` whose ``brokers`` name each broker's ``service_url`` and
    ``http_url``)."""
    if not data.startswith(b"HTTP/"):
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    if b"This port speaks the PigeonMQ" in body:
        return None  # one of our protocol ports: the node is slow, not the wrong one
    use = "the broker's pigeon:// port (6650 by default)"
    if role != "broker":
        use = f"a PigeonMQ {role} port"
    try:
        health = json.loads(body)
    except ValueError:
        health = None
    if isinstance(health, dict) and "status" in health and "checks" in health:
        brokers = [b for b in health.get("brokers") or [] if isinstance(b, dict)]
        mine = [b for b in brokers if str(b.get("http_url", "")).endswith(f":{port}")]
        url = next((str(b["service_url"]) for b in mine + brokers if b.get("service_url")), "")
        if url and role == "broker":
            use = url
        return f"port {port} is a PigeonMQ broker's admin HTTP port, not a {role} port: use {use}"
    status = head.split(b"\r\n", 1)[0].decode("latin-1")
    return f"port {port} is an HTTP server ({status!r}), not a PigeonMQ {role} port: use {use}"


#: the correlation id of the Kafka probe's request ("PIGE"): an answer that carries it
#: back is a Kafka broker's
KAFKA_PROBE_CORRELATION_ID = 0x50494745


def kafka_probe_request() -> bytes:
    """A Kafka ``ApiVersions`` v0 request (every Kafka broker answers v0, with error 35
    UNSUPPORTED_VERSION at worst).  Layout: int32 size (big-endian, the bytes after it),
    int16 api_key 18, int16 api_version 0, int32 correlation id
    (:data:`KAFKA_PROBE_CORRELATION_ID`), client id as int16 length + bytes."""
    client_id = b"pigeon-probe"
    body = struct.pack(">hhih", 18, 0, KAFKA_PROBE_CORRELATION_ID, len(client_id)) + client_id
    return struct.pack(">i", len(body)) + body


async def probe_kafka(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str, port: int, role: str
) -> str | None:
    """Send ``host:port`` (a new connection from ``open_stream``) a Kafka ``ApiVersions``
    request and say whether a Kafka broker answered (:func:`describe_kafka_answer`)."""
    data = await _exchange(open_stream, kafka_probe_request(), lambda d: len(d) >= 10)
    return describe_kafka_answer(data, port, role)


def describe_kafka_answer(data: bytes, port: int, role: str) -> str | None:
    """What :func:`probe_kafka` says of the bytes ``data`` port ``port`` answered (a pure
    function): a Kafka response is int32 size (big-endian), int32 correlation id (ours
    back), and for ApiVersions an int16 error code, 0 or 35 (UNSUPPORTED_VERSION).
    Anything else is no verdict (None)."""
    if len(data) < 10:
        return None
    size, correlation_id, error_code = struct.unpack_from(">iih", data)
    if not 6 <= size <= 1 << 20 or correlation_id != KAFKA_PROBE_CORRELATION_ID:
        return None
    if error_code not in (0, 35):
        return None
    if role == "broker":
        return (
            f"port {port} speaks the Kafka protocol; use a Kafka client or pigeon's"
            " service port (pigeon://, 6650 by default)"
        )
    return f"port {port} speaks the Kafka protocol, not the PigeonMQ {role} protocol"


def _tls_scheme(frame_type: Any) -> str:
    return "pigeon+ssl://" if frame_role(frame_type) == "broker" else "TLS"


def _wrong_service(address: str, *, server: str, client: str) -> str:
    """The error a client gets when it dialled a node of another kind (frame names)."""
    hint = {
        "broker": "use the broker's pigeon:// service URL, port 6650 by default",
        "bookie": "use a bookie's address, as the metadata store lists it",
    }.get(frame_role(client), "")
    return (
        f"{address} is a PigeonMQ {frame_role(server)} port, not a {frame_role(client)} port"
        f" ({hint})"
    )


def _refuse(conn: Connection, req: Request, exc: PigeonError) -> None:
    """Refuse a handshake: answer (or, for requestId 0, push) the error, one WARNING line,
    and close the connection."""
    log.warning("handshake refused conn=%s error=%s", conn.name, exc.message)
    if req.request_id:
        conn.respond_error(req.request_id, exc)
    else:
        conn.send_nowait("error", {"code": exc.wire_code, "message": exc.message})
    conn.close(exc)


class _HandshakeHandler:
    """Wraps a service handler until the peer has said ``connect``.

    ``authenticator``: the connect must carry credentials it accepts (the role goes to
    ``conn.role``).  ``refusal``: every connect is refused with it (a plaintext client
    on a TLS port)."""

    def __init__(
        self,
        service: Any,
        server_name: str,
        max_frame_size: int,
        max_message_size: int,
        *,
        authenticator: Authenticator | None = None,
        refusal: PigeonError | None = None,
    ):
        self.service = service
        self.server_name = server_name
        self.max_frame_size = max_frame_size
        self.max_message_size = max_message_size
        self.authenticator = authenticator
        self.refusal = refusal
        self.done = False

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("on_"):
            raise AttributeError(name)
        if not self.done:
            return self._refuse
        method = getattr(self.service, name)
        # kept on the instance: the next request of this kind finds it without coming
        # here (a service's handlers do not change while it serves)
        setattr(self, name, method)
        return method

    def _refuse(self, conn: Connection, req: Request) -> None:
        _refuse(conn, req, ProtocolError(f"first frame must be 'connect', got {req.kind!r}"))

    def on_connect(self, conn: Connection, req: Request) -> None:
        if self.done:  # only the first connect sets the connection up
            conn.respond_error(
                req.request_id, ProtocolError("this connection has already said connect")
            )
            return
        if self.refusal is not None:
            _refuse(conn, req, self.refusal)
            return
        ours = frame_name(conn.frame_type)
        theirs = str(req.body.frameType)
        if theirs and theirs != ours:
            _refuse(
                conn, req, ProtocolError(_wrong_service("this port", server=ours, client=theirs))
            )
            return
        version = req.body.protocolVersion
        if version != PROTOCOL_VERSION:
            exc = ProtocolVersionMismatch(
                f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})"
            )
            _refuse(conn, req, exc)
            return
        role = None
        if self.authenticator is not None:
            auth = AuthData(
                str(req.body.authMethod),
                bytes(req.body.authData),
                _peer_certificate(conn.stream),
                conn.name,
            )
            try:
                role = self.authenticator.authenticate(auth)
            except AuthenticationError as exc:
                _refuse(conn, req, exc)
                return
            conn.auth_expires = self.authenticator.expires_at(auth)
        conn.role = role
        conn.max_frame_size = self.max_frame_size
        conn.peer_name = str(req.body.clientName)
        conn.peer_version = version
        self.done = True
        conn.respond(
            req.request_id,
            "connected",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "serverName": self.server_name,
                "maxFrameSize": self.max_frame_size,
                "maxMessageSize": self.max_message_size,
                "frameType": ours,
                "authRole": role or "",
            },
        )
        opened = getattr(self.service, "connection_opened", None)
        if opened is not None:
            opened(conn)

    def connection_closed(self, conn: Connection) -> None:
        if self.done:
            hook = getattr(self.service, "connection_closed", None)
            if hook is not None:
                hook(conn)


def _peer_certificate(stream: trio.abc.Stream) -> dict[str, Any] | None:
    """The verified certificate of a TLS peer, or None (plaintext, none presented)."""
    if isinstance(stream, trio.SSLStream):
        try:
            cert = stream.getpeercert()
        except (ValueError, AttributeError):
            return None
        return cert or None
    return None


async def _starts_with_tls(stream: trio.abc.Stream) -> bool:
    """Does the peer open with a TLS record (0x16)?  Peeked, so nothing is consumed;
    streams that cannot peek (the in-memory network) are taken to speak TLS."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return True
    with trio.move_on_after(HANDSHAKE_PEEK_S):
        first = await sock.recv(1, socket.MSG_PEEK)
        return first == b"\x16" or not first
    return True  # said nothing yet: the TLS handshake's own deadline applies


#: how long a new connection on a TLS port may stay silent before we start the handshake
HANDSHAKE_PEEK_S = 10.0
#: the largest frame a peer may send before its ``connect`` is accepted (the connect
#: itself, with its credentials, is far smaller): an unauthenticated peer ties up no
#: large buffers
CONNECT_MAX_FRAME_SIZE = 64 * 1024
#: how long an accepted connection (after its TLS handshake) may take to say ``connect``
#: before it is closed: a peer that never does would otherwise hold its socket forever
CONNECT_DEADLINE_S = 30.0


async def _connect_deadline(conn: Connection, handler: _HandshakeHandler) -> None:
    """Close ``conn`` if it has not said ``connect`` within :data:`CONNECT_DEADLINE_S`."""
    await trio.sleep(CONNECT_DEADLINE_S)
    if not handler.done and not conn.closed:
        exc = ProtocolError(f"no 'connect' within {CONNECT_DEADLINE_S:g}s: connection closed")
        log.warning("handshake refused conn=%s error=%s", conn.name, exc.message)
        conn.abort(exc)


def listen_error(exc: OSError, what: str, host: str, port: int) -> ConfigError:
    """The one-line error of a port that cannot be had (another process holds it, a
    host that is not this machine's)."""
    reason = (exc.strerror or str(exc)).lower()
    hint = " (is another instance running? pick another port)"
    if exc.errno != errno.EADDRINUSE:
        hint = ""
    return ConfigError(f"{what} cannot listen on {host}:{port}: {reason}{hint}")


async def listen_tcp(port: int, host: str, what: str) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``, with a port that cannot be had as one ConfigError
    naming ``what`` and the address (see :func:`listen_error`), not a bare OSError."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise listen_error(exc, what, host, port) from exc


async def serve_tcp(
    service: Any,
    frame_type: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    server_name: str = "pigeon",
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    max_message_size: int = 5 * 1024 * 1024,
    tls: ServerTls | None = None,
    authenticator: Authenticator | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections for ``service`` until cancelled; reports ``(host, port)``.

    ``tls``: every connection is TLS (a failed handshake is one WARNING line).
    ``authenticator``: every connection must authenticate in its ``connect``."""
    network = active_network()

    async def handle(stream: trio.abc.Stream) -> None:
        try:
            peer = stream.socket.getpeername()  # type: ignore[attr-defined]
            name = f"{peer[0]}:{peer[1]}"
        except (OSError, AttributeError):
            name = "memory"
        refusal = None
        if tls is not None:
            if await _starts_with_tls(stream):
                try:
                    stream = await accept_tls(stream, tls)
                except (TlsError, ConnectionClosed) as exc:
                    log.warning("TLS handshake failed conn=%s error=%s", name, exc.message)
                    return
                if tls.require_client_cert and _peer_certificate(stream) is None:
                    refusal = TlsError(
                        "a client certificate signed by a CA this server trusts is required"
                        " (tls_require_trusted_client_cert): connect with AuthenticationTLS"
                    )
            else:
                refusal = TlsError(
                    f"this {frame_role(frame_type)} port takes TLS only: use"
                    f" {_tls_scheme(frame_type)} (or the plaintext port)"
                )
        handler = _HandshakeHandler(
            service,
            server_name,
            max_frame_size,
            max_message_size,
            authenticator=authenticator,
            refusal=refusal,
        )
        conn = Connection(
            stream,
            frame_type,
            handler=handler,
            max_frame_size=min(max_frame_size, CONNECT_MAX_FRAME_SIZE),
            name=name,
            serving=True,
        )
        try:
            async with trio.open_nursery() as watch:
                watch.start_soon(_connect_deadline, conn, handler)
                await conn.run()
                watch.cancel_scope.cancel()
        except Exception:
            log.exception("connection failed conn=%s", name)

    if network is not None:
        async with trio.open_nursery() as nursery:
            bound = network.listen(host, port, handle, nursery)
            try:
                task_status.started(bound)
                await trio.sleep_forever()
            finally:
                network.unlisten(*bound)
    listeners = await listen_tcp(port, host, server_name)
    sockname = listeners[0].socket.getsockname()
    bound = (sockname[0], sockname[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound)


def serve_local(
    service: Any,
    frame_type: Any,
    nursery: trio.Nursery,
    *,
    server_name: str = "pigeon",
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    max_message_size: int = 5 * 1024 * 1024,
) -> LocalStream:
    """Open an in-process link to ``service`` (see :mod:`pigeon.core._local_link`): its
    serving connection runs in ``nursery`` (it ends with it); returns the client end,
    for :func:`connect_local`.  The link is trusted: no TLS, no authentication; the
    serving connection's ``in_process`` is true and its ``role`` None.

    :raises ConnectionClosed: ``nursery`` no longer takes tasks (the service stopped)."""
    client, server = local_stream_pair()
    handler = _HandshakeHandler(service, server_name, max_frame_size, max_message_size)
    conn = Connection(
        server,
        frame_type,
        handler=handler,
        max_frame_size=max_frame_size,
        name="in-process",
        serving=True,
    )

    async def run() -> None:
        try:
            await conn.run()
        except Exception:
            log.exception("connection failed conn=%s", conn.name)

    try:
        nursery.start_soon(run)
    except RuntimeError:  # the nursery is closed: the service has stopped
        raise ConnectionClosed(f"{server_name} is not running") from None
    return client
