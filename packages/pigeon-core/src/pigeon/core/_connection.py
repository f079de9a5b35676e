"""One framed, pipelined connection: :class:`Connection` (see :mod:`pigeon.core._rpc`
for the RPC layer it belongs to: handshake, connecting, serving).

A reader task parses frames and resolves waiters by request id; a writer task writes the
queued frames in large writes: on TCP one vectored ``sendmsg`` of up to 512 buffers, so a
payload is never copied to be sent; on other streams (the in-memory network, TLS) small
frames joined and a large payload written as it is (joining it too would copy it into
fresh memory: dearer than the small write it saves).

On TCP a request's hops cost no trip through the scheduler (each is one on the latency
path of every request, and a loaded loop makes a trip long): a frame queued while nothing
waits to be written goes out at once, in a vectored write of its own, and the frames
queued after it wait for the writer task, which then sends them together (a burst still
goes out in few large writes); the reader dispatches the frames of what it received
before it yields to other tasks, not after (see :func:`_receive_socket`).

Over an in-process link (:mod:`pigeon.core._local_link`, a standalone's broker and its
bookie) there are no bytes: a queued frame goes straight into the peer's inbox (its
Cap'n Proto message as built, its payload by reference), and it is dispatched through the
same handlers (``_dispatch_message``).

**The end of a batch.**  A reader dispatches the frames of one read (or of one take of
its inbox) as a *batch*, and two kinds of work are kept for the batch's end, done by
the same task (:func:`_end_batch`), not by tasks woken for them:

* the frames sent meanwhile over in-process links whose receiving reader is idle: they
  are dispatched there, in the order sent, and what *their* handlers send joins the
  batch (a client's send -> the add to the local bookie -> its answer -> the receipt:
  one task, no trip through the scheduler; rounds are bounded, what is left wakes its
  reader);
* the frames queued meanwhile on idle TCP connections: one vectored write each (what
  the socket does not take goes to the writer task, which is woken only then).

A frame queued outside any batch (by a task that is no reader: a timer, a group
commit's answers, a dispatch loop) goes as before: written at once (TCP) or the
receiving reader woken (in-process).

On TLS the reader decrypts every whole record already received after each
``receive_some`` (:func:`_tls_records`): OpenSSL returns one record (16 KiB at most) per
read, and a trip through ``trio.SSLStream`` and the scheduler for each cost more than its
decryption.

Handlers are plain synchronous methods ``on_<kind>(conn, req)`` called by the reader task
while the Cap'n Proto reader in ``req.body`` is valid; work that must wait starts a task
in ``conn.nursery`` after copying what it needs out of the body.  ``req.payload`` (a
read-only memoryview) stays valid after the call: each frame is a buffer of its own that
nothing reuses, so a payload is stored or forwarded by reference, not copied.

Bad input, by how much of it can be trusted:

* a frame that does not decode (length prefix, segment table, root pointer): the stream
  can no longer be trusted; an ``error`` push (:class:`CorruptFrame`) and the connection
  is closed, with one WARNING line.  When the very first bytes are another protocol
  (HTTP, TLS, Kafka: :func:`~pigeon.core._framing.sniff_foreign_protocol`) the line and
  the error say so, and an HTTP client gets a ``400`` it can show;
* a frame that decodes but whose body does not (a bit-flipped pointer, an enum value this
  node does not know, text that is not UTF-8): every such field is read *before* the
  handler runs (:class:`~pigeon.core._schema.BodyChecker`), so the handler never starts;
  only that request is answered :class:`MalformedRequest` (one WARNING line, no
  traceback) and the connection keeps serving;
* a handler that raises a :class:`PigeonError` answers with it; anything else is a bug
  of ours: logged with its traceback and answered :class:`InternalError`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import ssl
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.core._capnp_fast import DECODE_ERRORS, Direct
from pigeon.core._framing import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameDecoder,
    Payload,
    build_message,
    capnp_message_size,
    consume_buffers,
    encode_frame,
    http_refusal,
    sniff_foreign_protocol,
)
from pigeon.core._local_link import LocalStream
from pigeon.core._schema import body_checker, decode_error_reason, frame_codec, frame_role
from pigeon.core.errors import (
    ConnectionClosed,
    CorruptFrame,
    InternalError,
    MalformedRequest,
    PigeonError,
    ProtocolError,
    TlsError,
    UnknownMessageType,
    error_from_code,
)
from pigeon.core.tls import describe_tls_error

__all__ = ["Connection", "Extract", "ReplyCallback", "Request", "frame_batch"]

#: the RPC layer's one logger: connection and handshake lines share its name
log = logging.getLogger("pigeon.core._rpc")

#: Callback of a request: ``callback(result, error)`` — exactly one is not None/unset.
ReplyCallback = Callable[[Any, BaseException | None], None]
#: Turns an answer's body (valid only during the call) into a Python value.
Extract = Callable[[Any, memoryview], Any]

_RECEIVE_SIZE = 256 * 1024
#: bytes of a connection's start kept to tell which protocol a wrong client speaks
_SNIFF_BYTES = 16
#: how long a refused peer may keep sending before the socket is closed (see _linger)
_LINGER_S = 0.5
_JOIN_LIMIT = 64 * 1024
#: the most plaintext one TLS record carries (what one read of a TLS stream returns)
_TLS_RECORD = 16 * 1024
#: buffers and bytes of one vectored write (Linux takes at most 1024 buffers per call)
_MAX_IOV = 512
_MAX_WRITE = 4 * 1024 * 1024
_HIGH_WATER = 8 * 1024 * 1024
#: the vectored write of a frame written at once (None where the OS has none)
_writev: Callable[[int, list[Any]], int] | None = getattr(os, "writev", None)


#: what a plaintext port answers a TLS ClientHello: a TLS record (alert, TLS 1.0 framing
#: every version reads) holding a fatal ``protocol_version`` alert
TLS_REFUSAL_ALERT = bytes([0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x46])

#: rounds of in-process hand-overs at the end of one batch (each round dispatches the
#: frames sent in the previous one); what is left then wakes its readers
_BATCH_ROUNDS = 16


class _Batch(threading.local):
    """The batch a reader of this thread's trio run dispatches (see the module doc)."""

    def __init__(self) -> None:
        self.active = False
        #: connections whose in-process inbox this batch takes at its end
        self.local: list[Connection] = []
        #: TCP connections with frames queued in this batch, written at its end
        self.flush: list[Connection] = []


_batch = _Batch()


class frame_batch:
    """``with frame_batch():`` -- the frames sent in the block by a task that is no
    reader (a subscription's dispatch pass) are a batch (see the module doc): each TCP
    connection gets one write at the end, its writer task is not woken; nested in a
    batch already running, nothing changes."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = not _batch.active
        _batch.active = True

    def __exit__(self, *exc: object) -> None:
        if self._outer:
            _end_batch()


def _end_batch() -> None:
    """The work kept for the end of a batch: the in-process hand-overs (rounds, bounded),
    then one write per TCP connection.  Never raises (a failing hand-over fails its own
    connection)."""
    b = _batch
    try:
        for _ in range(_BATCH_ROUNDS):
            if not b.local:
                break
            conns, b.local = b.local, []
            for conn in conns:
                conn._take_local()
    finally:
        b.active = False
        try:
            conns, b.local = b.local, []
            for conn in conns:  # left over: their readers take them
                if conn._local is not None:
                    conn._local.unclaim()
        finally:
            # (whatever happened above: a frame left queued here would never be sent)
            conns, b.flush = b.flush, []
            for conn in conns:
                conn._flush_batch()


def _default_extract(body: Any, payload: memoryview) -> Any:
    if body is None:
        return None
    return body.to_dict()


@dataclass(slots=True)
class Request:
    """One incoming frame on the serving side; ``body`` is valid during the handler call,
    ``payload`` as long as it is referenced."""

    request_id: int
    kind: str
    body: Any
    payload: memoryview


@dataclass(slots=True)
class _Pending:
    expect: str | None
    extract: Extract
    callback: ReplyCallback


class Connection:
    """One framed, pipelined connection.

    ``frame_type`` is the root struct (``BrokerFrame`` or ``BookieFrame``).  ``handler``
    receives incoming requests (serving side) and pushes (client side) through methods
    named ``on_<kind>``.  ``serving`` is true on the accepting side: it answers a client
    of another protocol (e.g. HTTP) in that protocol where it can.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        frame_type: Any,
        *,
        handler: Any = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        name: str = "",
        serving: bool = False,
    ) -> None:
        self.stream = stream
        self.frame_type = frame_type
        self.serving = serving
        self._checker = body_checker(frame_type)
        self._fast = frame_codec(frame_type)
        self.handler = handler
        self._decoder = FrameDecoder(max_frame_size)
        self.name = name
        self.peer_name = ""
        self.peer_version = 0
        #: the role the connect handshake authenticated (None: no authentication)
        self.role: str | None = None
        #: when the credentials of that role expire (Unix seconds: a token's ``exp``;
        #: None: never); the server closes the connection then
        self.auth_expires: float | None = None
        self.nursery: trio.Nursery | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._out: deque[Any] = deque()
        self._out_bytes = 0
        self._out_ready = trio.Event()
        #: an in-process link (:mod:`pigeon.core._local_link`): frames, not bytes
        self._local: LocalStream | None = stream if isinstance(stream, LocalStream) else None
        if self._local is not None:
            self._local.on_frames = self._claim_local
        #: frames queued in the running batch, written at its end (:meth:`_flush_batch`)
        self._batched = False
        #: the socket of a TCP stream, written at once when idle (see :meth:`_write_now`)
        self._socket: Any = (
            stream.socket if isinstance(stream, trio.SocketStream) and _writev else None
        )
        #: the writer holds frames taken off ``_out``, or has yet to run after a frame
        #: was written at once: a new frame waits in the queue behind them
        self._writing = False
        self._drained = trio.Event()
        self._closed = False
        self._close_reason: BaseException | None = None
        self.closed_event = trio.Event()
        self._writer_done = trio.Event()
        self._reader_scope = trio.CancelScope()
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self._head = b""  # the first bytes received, for sniff_foreign_protocol

    @property
    def max_frame_size(self) -> int:
        """The largest frame accepted from the peer (a server keeps it small until the
        peer has said ``connect``: see :func:`pigeon.core.rpc.serve_tcp`)."""
        return self._decoder.max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, size: int) -> None:
        self._decoder.max_frame_size = size

    # ------------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_process(self) -> bool:
        """An in-process link (:mod:`pigeon.core._local_link`), trusted: only code of this
        process can open one."""
        return self._local is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the reader and writer until the connection ends."""
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._writer)
                task_status.started()
                with self._reader_scope:
                    await self._reader()
                # The reader ended: flush what is queued (bounded), then stop the writer.
                self._closed = True
                self._out_ready.set()
                with trio.move_on_after(1.0):
                    await self._writer_done.wait()
                if self.serving and isinstance(self._close_reason, ProtocolError):
                    await self._linger()
                nursery.cancel_scope.cancel()
        finally:
            self._shutdown(self._close_reason or ConnectionClosed(f"connection {self.name} closed"))
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.stream.aclose()

    async def _linger(self) -> None:
        """After refusing a peer's bytes: half-close, and read (and drop) what it still
        sends for a moment.  Closing a socket with unread input resets the connection,
        and the reset can destroy our error answer before the peer has read it."""
        with trio.move_on_after(_LINGER_S), contextlib.suppress(Exception):
            await self.stream.send_eof()  # type: ignore[attr-defined]
            for _ in range(64):  # bounded: at most 64 reads
                if not await self.stream.receive_some(_RECEIVE_SIZE):
                    break

    def abort(self, reason: BaseException) -> None:
        """End the connection now (the peer stopped answering): nothing queued is
        written, and every pending request is called back with ``reason``."""
        if self._close_reason is None:
            self._close_reason = reason
        self._closed = True
        self._out_ready.set()
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()
        else:
            self._reader_scope.cancel()

    def close(self, reason: BaseException | None = None) -> None:
        """Close soon: queued frames are still written, then the stream ends."""
        if self._close_reason is None:
            self._close_reason = reason or ConnectionClosed(f"connection {self.name} closed")
        self._closed = True
        self._out_ready.set()

    def _shutdown(self, reason: BaseException) -> None:
        self._closed = True
        pending, self._pending = self._pending, {}
        for p in pending.values():
            exc = reason if isinstance(reason, PigeonError) else ConnectionClosed(str(reason))
            with contextlib.suppress(Exception):
                p.callback(None, exc)
        self._drained.set()
        self.closed_event.set()
        hook = getattr(self.handler, "connection_closed", None)
        if hook is not None:
            try:
                hook(self)
            except Exception:
                log.exception("connection_closed handler failed conn=%s", self.name)

    # ------------------------------------------------------------------ sending

    @property
    def outgoing_bytes(self) -> int:
        return self._out_bytes

    def _enqueue_bytes(self, data: bytes) -> None:
        """Queue bytes that are not a frame (an answer in a foreign client's protocol)."""
        self._out.append(data)
        self._out_bytes += len(data)
        self._out_ready.set()

    def _enqueue(self, message: Any, payload: Payload | None) -> None:
        if self._closed:
            raise ConnectionClosed(f"connection {self.name} is closed")
        if self._local is not None:
            try:
                self.bytes_out += self._local.send_frame(message, payload)
            except trio.ClosedResourceError:
                raise ConnectionClosed(f"connection {self.name} is closed") from None
            return
        parts = encode_frame(message, payload)
        if not self._writing and self._socket is not None and not self._out:
            if _batch.active:
                # written at the end of the batch, with the frames queued after it
                self._writing = self._batched = True
                _batch.flush.append(self)
                for part in parts:
                    self._out.append(part)
                    self._out_bytes += len(part)
                return
            parts = self._write_now(parts)
            if not parts:
                return
        for part in parts:
            self._out.append(part)
            self._out_bytes += len(part)
        if not self._batched:  # (a batch's frames are written at its end: no writer woken)
            self._out_ready.set()

    def _write_now(self, parts: list[Any]) -> list[Any]:
        """Write a frame while the writer is idle and nothing is queued; returns what
        the socket did not take (the writer sends it).

        The writer is woken all the same: until it has run, later frames queue behind
        this one and go out together in its next write (the frames of one burst are not
        a write each)."""
        self._writing = True
        self._out_ready.set()
        fd = self._socket.fileno()  # -1 once closed: never a number reused meanwhile
        writev = _writev
        if fd < 0 or writev is None or len(parts) > _MAX_IOV:
            return parts
        try:
            sent = writev(fd, parts)
        except OSError:  # full (BlockingIOError) or broken: the writer meets it again
            return parts
        self.bytes_out += sent
        return consume_buffers(parts, sent)

    def _flush_batch(self) -> None:
        """The end of a batch: one vectored write of what was queued in it; what the
        socket does not take (or all of it, the socket gone) is left to the writer."""
        self._batched = False
        out = self._out
        fd = self._socket.fileno()
        if out and fd >= 0 and _writev is not None:
            parts = _take_vector(out)
            size = sum(map(len, parts))
            self._out_bytes -= size
            try:
                sent = _writev(fd, parts)
            except OSError:  # full (BlockingIOError) or broken: the writer meets it again
                sent = 0
            self.bytes_out += sent
            rest = consume_buffers(parts, sent)
            if rest:
                out.extendleft(reversed(rest))
                self._out_bytes += sum(map(len, rest))
        if out or self._closed:
            self._out_ready.set()  # the writer sends the rest (and ends if closed)
        else:
            self._writing = False

    def _claim_local(self) -> bool:
        """A frame arrived over the in-process link while the reader waits: take it at
        the end of the running batch, if there is one (see the module doc)."""
        b = _batch
        if not b.active or self._closed:
            return False
        b.local.append(self)
        return True

    def _take_local(self) -> None:
        """Dispatch what the in-process inbox holds, at the end of another reader's batch."""
        link = self._local
        if link is None:
            return
        if self._closed:
            link.unclaim()
            return
        try:
            for message, payload in link.take_frames():
                self.frames_in += 1
                self.bytes_in += len(message) + len(payload)
                self._dispatch_message(message, payload)
        except Exception as exc:
            link.fail(exc)

    def _message(self, request_id: int, kind: str, fields: dict[str, Any] | None) -> Any:
        """The message of a frame to send: its bytes; over an in-process link, a frame of
        the per-entry path as its decoded body (:meth:`FrameCodec.direct`: the receiver
        does not decode what was just encoded)."""
        if self._local is not None:
            direct = self._fast.direct(request_id, kind, fields)
            if direct is not None:
                return direct
        return build_message(self.frame_type, request_id, kind, fields)

    def send_nowait(
        self,
        kind: str,
        fields: dict[str, Any] | None = None,
        payload: Payload | None = None,
        *,
        request_id: int = 0,
    ) -> None:
        """Queue one frame (a push, an answer, or a request that wants no answer); a
        ``payload`` given as a list of buffers is written as they are, unjoined."""
        self._enqueue(self._message(request_id, kind, fields), payload)

    def send_raw_nowait(self, message: bytes, payload: Payload | None = None) -> None:
        """Queue a frame whose Cap'n Proto message the caller built."""
        self._enqueue(message, payload)

    def respond(
        self,
        request_id: int,
        kind: str,
        fields: dict[str, Any] | None = None,
        payload: Payload | None = None,
    ) -> None:
        if request_id == 0 or self._closed:
            return
        self.send_nowait(kind, fields, payload, request_id=request_id)

    def respond_error(self, request_id: int, exc: PigeonError) -> None:
        if request_id == 0 or self._closed:
            return
        self.send_nowait(
            "error", {"code": exc.wire_code, "message": exc.message}, request_id=request_id
        )

    def request_nowait(
        self,
        kind: str,
        fields: dict[str, Any] | None,
        callback: ReplyCallback,
        *,
        payload: Payload | None = None,
        expect: str | None = None,
        extract: Extract = _default_extract,
    ) -> int:
        """Send a request; ``callback(result, error)`` runs in the reader task on its answer."""
        request_id = next(self._ids)
        message = self._message(request_id, kind, fields)
        self._enqueue(message, payload)
        self._pending[request_id] = _Pending(expect, extract, callback)
        return request_id

    async def request(
        self,
        kind: str,
        fields: dict[str, Any] | None = None,
        *,
        payload: Payload | None = None,
        expect: str | None = None,
        extract: Extract = _default_extract,
    ) -> Any:
        """Send a request and wait for its answer; raises the typed error the peer sent."""
        done = trio.Event()
        box: list[Any] = []

        def callback(result: Any, error: BaseException | None) -> None:
            box.append((result, error))
            done.set()

        request_id = self.request_nowait(
            kind, fields, callback, payload=payload, expect=expect, extract=extract
        )
        try:
            await done.wait()
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        result, error = box[0]
        if error is not None:
            raise error
        return result

    async def wait_writable(self, high_water: int = _HIGH_WATER) -> None:
        """Wait until the queue of unsent bytes is below ``high_water`` (backpressure)."""
        while self._out_bytes > high_water and not self._closed:
            if self._drained.is_set():
                self._drained = trio.Event()  # shared by every waiter; the writer sets it
            await self._drained.wait()
        if self._closed:
            raise ConnectionClosed(f"connection {self.name} is closed")

    async def _writer(self) -> None:
        try:
            await self._write_loop()
        finally:
            self._writer_done.set()
            if self._closed:
                # close() was called and the queue is flushed (or the stream broke): stop
                # reading too, so that the stream ends instead of waiting for the peer.
                self._reader_scope.cancel()

    async def _write_loop(self) -> None:
        out = self._out
        # A TCP stream writes the queued buffers with one sendmsg (a vectored write: no
        # copy); other streams (the in-memory network, TLS) take joined small parts.
        sock = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        sendmsg = getattr(sock, "sendmsg", None)  # (Windows sockets have none)
        while True:
            if not out:
                self._writing = False  # idle: the next frame may be written at once
                if self._closed:
                    return
                self._out_ready = trio.Event()
                await self._out_ready.wait()
                continue
            self._writing = True
            parts = _take_vector(out) if sendmsg is not None else _take_joined(out)
            size = sum(map(len, parts))
            self._out_bytes -= size
            try:
                if sendmsg is not None:
                    while parts:
                        parts = consume_buffers(parts, await sendmsg(parts))
                else:
                    await self.stream.send_all(parts[0])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.close(self._lost(exc))
                with contextlib.suppress(Exception):
                    await self.stream.aclose()
                return
            self.bytes_out += size
            if self._out_bytes <= _HIGH_WATER // 2:
                self._drained.set()

    def _lost(self, exc: BaseException) -> PigeonError:
        """Why the stream broke: a TLS peer that refused our certificate (or its
        absence; TLS 1.3 says so only after the handshake) is a :class:`TlsError`, which
        retrying will not mend; anything else is a retriable :class:`ConnectionClosed`."""
        cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
        if isinstance(cause, ssl.SSLError) and "CERTIFICATE" in str(cause.reason or "").upper():
            return TlsError(f"connection {self.name}: {describe_tls_error(cause)}")
        return ConnectionClosed(f"connection {self.name} lost: {exc}")

    # ------------------------------------------------------------------ receiving

    async def _reader(self) -> None:
        decoder = self._decoder
        stream = self.stream
        more = _tls_records(stream)
        # a TLS read returns one record at most: asking for more only allocates more
        size = _TLS_RECORD if more is not None else _RECEIVE_SIZE
        sock = self._socket
        data: bytes | bytearray
        #: the last read took all the socket had (fewer bytes than asked for): the next
        #: one waits for more first, instead of a read that fails with EAGAIN
        drained = False
        try:
            if self._local is not None:
                await self._read_local(self._local)
                return
            while True:
                # the rest of a large frame goes straight into its buffer (plain TCP, once
                # the first bytes were looked at): no chunk allocated, no copy out of it
                space = (
                    decoder.assembly_space()
                    if sock is not None and more is None and len(self._head) >= _SNIFF_BYTES
                    else None
                )
                data = b""
                try:
                    if space is not None:
                        with space:
                            got = await _receive_socket_into(sock, space, drained)
                            drained = got < len(space)
                    elif sock is not None:
                        data = await _receive_socket(sock, size, drained)
                        got = len(data)
                        drained = got < size
                    else:
                        data = await stream.receive_some(size)
                        got = len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self._close_reason = self._close_reason or self._lost(exc)
                    return
                if not got:
                    return
                if space is not None:
                    self.bytes_in += got
                    decoder.assembled(got)
                if data and len(self._head) < _SNIFF_BYTES:
                    self._head += bytes(data[: _SNIFF_BYTES - len(self._head)])
                    # Another protocol may wait for our answer before sending enough bytes
                    # to make a frame (a short TLS ClientHello): look before framing.
                    foreign = sniff_foreign_protocol(self._head) if not self.frames_in else None
                    if foreign is not None:
                        self._foreign_peer(foreign)
                        return
                if data:
                    self.bytes_in += len(data)
                    decoder.feed(data)
                if more is not None:
                    while extra := more():
                        self.bytes_in += len(extra)
                        decoder.feed(extra)
                outer = not _batch.active
                _batch.active = True
                try:
                    for frame in decoder.frames():
                        self.frames_in += 1
                        self._dispatch(frame)
                finally:
                    if outer:
                        _end_batch()
                if self._closed:
                    return
                if sock is not None and not drained:
                    # the frames are dispatched: now let the other tasks run (a peer
                    # that never stops sending must not starve them); a drained socket's
                    # next read waits for readability, which lets them run too
                    await trio.lowlevel.checkpoint()
        except ProtocolError as exc:
            foreign = sniff_foreign_protocol(self._head) if self.frames_in <= 1 else None
            if foreign is not None:
                self._foreign_peer(foreign)
                return
            if not self.serving and not self.frames_in:
                # a server whose first answer is no frame at all: not a PigeonMQ node
                role = frame_role(self.frame_type)
                self._close_reason = ProtocolError(
                    f"the server answered with bytes that are not the PigeonMQ {role}"
                    f" protocol ({bytes(self._head[:16])!r}): is it a PigeonMQ {role} port?"
                )
                log.warning("not a PigeonMQ server conn=%s error=%s", self.name, exc)
                return
            log.warning("protocol error conn=%s error=%s", self.name, exc)
            self._close_reason = exc
            with contextlib.suppress(ConnectionClosed):
                self.send_nowait("error", {"code": exc.wire_code, "message": exc.message})

    async def _read_local(self, link: LocalStream) -> None:
        """The reader of an in-process link: dispatch every frame queued, then wait."""
        while True:
            try:
                frames = await link.receive_frames()
            except trio.ClosedResourceError:
                return
            if not frames:
                return
            outer = not _batch.active
            _batch.active = True
            try:
                for message, payload in frames:
                    self.frames_in += 1
                    self.bytes_in += len(message) + len(payload)
                    self._dispatch_message(message, payload)
            finally:
                if outer:
                    _end_batch()
            if self._closed:
                return

    def _foreign_peer(self, foreign: str) -> None:
        """The first bytes from the peer were ``foreign`` (another protocol): say so once."""
        role = frame_role(self.frame_type)
        if self.serving:
            log.warning(
                "not a PigeonMQ client conn=%s received=%r port=%s: closing",
                self.name,
                foreign,
                role,
            )
            text = f"This port speaks the PigeonMQ {role} protocol; it received {foreign}."
            self._close_reason = ProtocolError(text)
            if foreign == "an HTTP request":
                if role == "broker":
                    text += (
                        " Clients connect with a pigeon:// URL; the admin REST API is on the"
                        " broker's HTTP port (http_port, 8080 by default)."
                    )
                with contextlib.suppress(ConnectionClosed):
                    self._enqueue_bytes(http_refusal(text))
            elif foreign == "a TLS handshake":
                # a fatal protocol_version alert: the TLS client fails at once with an
                # error that says TLS was refused (not a bare close it would retry)
                with contextlib.suppress(ConnectionClosed):
                    self._enqueue_bytes(TLS_REFUSAL_ALERT)
            return
        self._close_reason = ProtocolError(
            f"the server answered with {foreign}, not the PigeonMQ {role} protocol:"
            " is it the right address (not an HTTP or admin port)?"
        )
        log.warning("not a PigeonMQ server conn=%s received=%r", self.name, foreign)

    def _dispatch(self, frame: bytes | bytearray) -> None:
        # The frame is the decoder's no more: a handler may keep views of its payload.
        view = memoryview(frame).toreadonly()
        size = capnp_message_size(view)
        payload = view[size:]
        self._dispatch_message(frame[:size] if payload else frame, payload)

    def _dispatch_message(self, message: bytes | bytearray | Direct, payload: memoryview) -> None:
        """Dispatch one frame: its Cap'n Proto ``message`` and its ``payload``.

        A frame of the per-entry path is decoded at fixed offsets (every field read and
        checked: :mod:`pigeon.core._capnp_fast`); any other, and any such frame that
        codec does not take (a malformed one among them), through pycapnp, whose errors
        are the ones a peer sees."""
        fast: tuple[int, str, Any] | None
        if isinstance(message, Direct):
            fast = message.fast
        else:
            try:
                fast = self._fast.decode(message)
            except DECODE_ERRORS:
                fast = None
        if fast is not None:
            request_id, kind, body = fast
            pending = self._pending.pop(request_id, None) if request_id else None
            if pending is not None:
                self._resolve(pending, kind, None, payload, body)
            else:
                self._handle(request_id, kind, None, payload, body)
            return
        try:
            ctx = self.frame_type.from_bytes(message)
            msg = ctx.__enter__()
        except Exception as exc:
            raise CorruptFrame(f"undecodable frame: {decode_error_reason(exc)}") from None
        try:
            try:
                request_id = msg.requestId
            except Exception as exc:
                raise CorruptFrame(f"undecodable frame: {decode_error_reason(exc)}") from None
            pending = self._pending.pop(request_id, None) if request_id else None
            try:
                kind = msg.which()
            except Exception:
                # A union member this schema does not know (a newer peer): refuse this one
                # frame and keep the connection.
                unknown = UnknownMessageType("message type unknown to this node")
                if pending is not None:
                    pending.callback(None, unknown)
                else:
                    self.respond_error(request_id, unknown)
                return
            if pending is not None:
                self._resolve(pending, kind, msg, payload)
            else:
                self._handle(request_id, kind, msg, payload)
        finally:
            ctx.__exit__(None, None, None)

    def _resolve(
        self, pending: _Pending, kind: str, msg: Any, payload: memoryview, body: Any = None
    ) -> None:
        """Answer ``pending`` with a frame: pycapnp's reader ``msg``, or (``msg`` None) a
        ``body`` the fixed-layout codec decoded and checked."""
        if kind == "error":
            try:
                err = body if msg is None else self._checker.body(msg, kind)
                error = error_from_code(err.code, err.message)
            except MalformedRequest as exc:
                error = CorruptFrame(f"undecodable error answer: {exc.message}")
            pending.callback(None, error)
            return
        if pending.expect is not None and kind != pending.expect:
            pending.callback(
                None, ProtocolError(f"expected {pending.expect!r} answer, got {kind!r}")
            )
            return
        if msg is not None:
            body = getattr(msg, kind) if kind not in ("ok", "ping") else None
        try:
            result = pending.extract(body, payload)
        except Exception as exc:
            pending.callback(None, CorruptFrame(f"bad {kind!r} answer: {exc}"))
            return
        pending.callback(result, None)

    def _handle(
        self, request_id: int, kind: str, msg: Any, payload: memoryview, body: Any = None
    ) -> None:
        """Serve a request or push: pycapnp's reader ``msg``, or (``msg`` None) a ``body``
        the fixed-layout codec decoded and checked."""
        if kind == "ping":
            self.respond(request_id, "ok")
            return
        method = getattr(self.handler, "on_" + kind, None) if self.handler is not None else None
        if method is None and kind != "error":
            self.respond_error(request_id, UnknownMessageType(f"{kind!r} is not served here"))
            return
        if msg is not None:
            try:
                # Serving: every field is read before the handler runs, so a malformed
                # request has no effect at all.  A client trusts the server it dialled
                # with its pushes (a message push of many entries would pay for the
                # check): it reads lazily and only checks the body when the handler
                # failed (below).
                body = self._checker.body(msg, kind, check=self.serving or method is None)
            except MalformedRequest as exc:
                self._malformed(request_id, kind, exc)
                return
        if method is None:
            log.warning("peer error conn=%s code=%s message=%s", self.name, body.code, body.message)
            return
        try:
            method(self, Request(request_id, kind, body, payload))
        except PigeonError as exc:
            # Also a ProtocolError raised by a handler (e.g. a corrupt batch): it answers
            # the request; a handler that wants the connection gone calls conn.close().
            self.respond_error(request_id, exc)
        except Exception as exc:
            bad = None if self.serving or msg is None else self._checker.check(msg, kind)
            if bad is None and _is_traversal_limit(exc):  # checked, then read once more
                bad = MalformedRequest(f"malformed {kind}: {exc}")
            if bad is not None:
                self._malformed(request_id, kind, bad)
                return
            log.exception("handler failed conn=%s kind=%s", self.name, kind)
            self.respond_error(
                request_id,
                InternalError(f"internal error handling {kind}: {type(exc).__name__}: {exc}"),
            )

    def _malformed(self, request_id: int, kind: str, exc: MalformedRequest) -> None:
        """One line, no traceback: the peer's bytes are wrong, not our code."""
        log.warning(
            "malformed request conn=%s peer=%s kind=%s request_id=%d error=%s",
            self.name,
            self.peer_name or "?",
            kind,
            request_id,
            exc.message,
        )
        self.respond_error(request_id, exc)


async def _receive_socket(sock: Any, size: int, wait_first: bool = False) -> bytes:
    """Up to ``size`` bytes from a TCP stream's socket (``b""`` at its end), like
    ``SocketStream.receive_some`` but returning before it yields to the scheduler when
    bytes are there already: the caller dispatches them first, then yields
    (``trio.lowlevel.checkpoint``), so a request's frame is handled in the scheduler pass
    that found it readable, not in the next one.  ``wait_first``: the caller's last read
    drained the socket, so wait until it is readable before reading (a read would most
    likely fail with EAGAIN: a wasted system call per frame at moderate rates).  Raises
    ClosedResourceError once the socket is closed, OSError when the connection breaks."""
    data: bytes = await _read_socket(sock, wait_first, os.read, size)
    return data


async def _receive_socket_into(sock: Any, space: memoryview, wait_first: bool) -> int:
    """:func:`_receive_socket`, received into ``space``: the number of bytes (0 at the
    stream's end)."""
    n: int = await _read_socket(sock, wait_first, os.readv, [space])
    return n


async def _read_socket(sock: Any, wait_first: bool, read: Any, arg: Any) -> Any:
    """``read(fd, arg)`` once the socket is readable (see :func:`_receive_socket`)."""
    if wait_first and sock.fileno() >= 0:
        await trio.lowlevel.wait_readable(sock)
    while True:
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the socket was closed")
        try:
            return read(fd, arg)
        except BlockingIOError:
            pass
        await trio.lowlevel.wait_readable(sock)


def _take_vector(out: deque[Any]) -> list[Any]:
    """The queued buffers for one vectored write (at most _MAX_IOV of them, about
    _MAX_WRITE bytes), taken off ``out``."""
    parts: list[Any] = []
    size = 0
    while out and len(parts) < _MAX_IOV and size < _MAX_WRITE:
        part = out.popleft()
        parts.append(part)
        size += len(part)
    return parts


def _take_joined(out: deque[Any]) -> list[Any]:
    """One buffer for one plain write, taken off ``out``: a large part alone, else the
    small parts up to the next large one joined (up to 4 * _JOIN_LIMIT bytes)."""
    if len(out[0]) >= _JOIN_LIMIT:
        return [out.popleft()]
    small: list[Any] = []
    size = 0
    while out and len(out[0]) < _JOIN_LIMIT and size < 4 * _JOIN_LIMIT:
        part = out.popleft()
        small.append(part)
        size += len(part)
    return [b"".join(small) if len(small) > 1 else small[0]]


def _tls_records(stream: Any) -> Callable[[], bytes | None] | None:
    """For a ``trio.SSLStream``: a function that returns the plaintext of the next whole
    record already received (in its incoming buffer), or None when there is none; for any
    other stream None.

    OpenSSL gives one record (16 KiB at most) per read, and ``SSLStream.receive_some``
    yields to the scheduler on each, so a 1 MiB batch took 64 trips through both.  Reading
    the records that are already in is synchronous (no ``await`` between reads, as
    ``SSLStream`` itself does): whatever a read leaves to send (a TLS 1.3 key update) is
    sent by the stream's next operation, and an error (or the peer's close) is left to
    the next ``receive_some``, which meets it again and reports it as usual.  Relies on
    ``SSLStream``'s ``_ssl_object`` and ``_incoming``: without them, None (each record
    goes through ``receive_some``)."""
    if not isinstance(stream, trio.SSLStream):
        return None
    ssl_object = getattr(stream, "_ssl_object", None)
    incoming = getattr(stream, "_incoming", None)
    if not isinstance(ssl_object, ssl.SSLObject) or not isinstance(incoming, ssl.MemoryBIO):
        return None
    read = ssl_object.read

    def more() -> bytes | None:
        if not incoming.pending:
            return None
        try:
            data: bytes = read(_TLS_RECORD)
        except ssl.SSLError:  # an incomplete record (SSLWantReadError) or a broken stream
            return None
        return data or None

    return more


def _is_traversal_limit(exc: Exception) -> bool:
    return "traversal limit" in str(exc) and type(exc).__name__ == "KjException"
