"""An in-process link: two :class:`~pigeon.core._connection.Connection`\\ s in one trio run
that hand each other frames, not bytes.

``pigeon standalone`` runs its broker and its bookie in one process; over loopback TCP
each add crossed the kernel twice (the request, its answer) and was re-framed and parsed
on both sides.  A :class:`LocalStream` pair carries the same frames (the Cap'n Proto
message of each, as built, and its payload; a frame of the per-entry path -- ``addEntry``,
``addResponse`` -- as the body its receiver would decode, not encoded and decoded again:
:meth:`~pigeon.core._capnp_fast.FrameCodec.direct`) from one connection's ``_enqueue``
straight into the other's inbox, which is dispatched exactly as frames read from a socket (same
handlers, same answers, same typed errors), in the order sent, by one of two takers:

* a frame sent while a reader dispatches what it received (a client's send whose
  handler adds an entry, a bookie's answer to that add) is dispatched at the end of that
  batch, by the same task (:class:`~pigeon.core._connection.Connection`'s end of batch),
  when the receiving end's reader is idle: no trip through the scheduler at all;
* any other (sent by a task that is no reader: a group commit's answers under
  ``fsync=always``; the receiver busy or closing) wakes the receiving end's reader task,
  which takes everything queued: one trip through the scheduler per direction.

No system call, no copy of a request's payload.

Payloads: a request's payload is handed over by reference (a read-only view), as a
socket's writer would have sent that very buffer later (the sender must not change it
after sending, on any link).  An answer's payload (a read's entries) is copied into one
buffer, as the socket's receive did: the serving side may answer with views of storage it
reuses or unmaps.

The link is trusted: it can only be opened by code in the process that runs both ends,
so it has no TLS and the serving side skips authentication
(:attr:`Connection.in_process`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from pigeon.core._capnp_fast import Direct
from pigeon.core._framing import Payload

__all__ = ["LocalStream", "local_stream_pair"]

#: (Cap'n Proto message, payload) of one frame; a frame of the per-entry path goes as
#: its decoded body (:class:`~pigeon.core._capnp_fast.Direct`), not as a message
Frame = tuple[bytes | Direct, memoryview]

_EMPTY = memoryview(b"")


class LocalStream(trio.abc.Stream):
    """One end of an in-process link (see the module doc).  As a ``trio.abc.Stream`` it
    carries no bytes: :class:`~pigeon.core._connection.Connection` uses
    :meth:`send_frame` and :meth:`receive_frames` instead."""

    def __init__(self, *, copy_payloads: bool) -> None:
        self._peer: LocalStream | None = None
        self._copy_payloads = copy_payloads
        self._inbox: deque[Frame] = deque()
        self._wake = trio.Event()
        self._eof = False
        self._closed = False
        #: the reader waits in :meth:`receive_frames` (nothing queued)
        self._waiting = False
        #: a taker other than the reader will take the inbox (see :attr:`on_frames`)
        self._claimed = False
        #: why a frame taken by another taker failed: the reader raises it
        self._failure: BaseException | None = None
        #: set by the receiving connection: called when a frame is queued while the
        #: reader waits; True when the caller will take the inbox itself (the reader
        #: stays asleep), False to wake the reader
        self.on_frames: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ frames

    def send_frame(self, message: bytes | Direct, payload: Payload | None) -> int:
        """Queue one frame in the peer's inbox and wake its reader; returns its size.
        A frame sent after the peer closed is dropped: this end's reader sees the end of
        the link next, and the connection fails what is pending (as on a socket)."""
        if self._closed:
            raise trio.ClosedResourceError("this end of the in-process link is closed")
        view = _payload_view(payload, copy=self._copy_payloads)
        peer = self._peer
        if peer is not None and not peer._closed:
            peer._inbox.append((message, view))
            if not peer._claimed:
                claim = peer.on_frames
                if peer._waiting and claim is not None and claim():
                    peer._claimed = True
                else:
                    peer._wake.set()
        return len(message) + len(view)

    def take_frames(self) -> list[Frame]:
        """Every frame queued, for the taker that claimed them (see :attr:`on_frames`)."""
        self._claimed = False
        frames = list(self._inbox)
        self._inbox.clear()
        return frames

    def unclaim(self) -> None:
        """The claimed frames are left to the reader: wake it."""
        self._claimed = False
        self._wake.set()

    def fail(self, exc: BaseException) -> None:
        """A frame taken by another taker failed (a bug of ours): the reader raises
        ``exc``, ending the connection as if it had dispatched that frame itself."""
        self._failure = exc
        self._wake.set()

    async def receive_frames(self) -> list[Frame]:
        """Every frame queued for this end (waiting for one); ``[]`` once the peer has
        closed and everything it sent has been taken."""
        if self._inbox:
            await trio.lowlevel.checkpoint()
        else:
            while not self._inbox and not self._eof and self._failure is None:
                if self._closed:
                    raise trio.ClosedResourceError("this end of the in-process link is closed")
                self._wake = trio.Event()
                self._waiting = True
                try:
                    await self._wake.wait()
                finally:
                    self._waiting = False
        if self._failure is not None:
            raise self._failure
        self._claimed = False
        frames = list(self._inbox)
        self._inbox.clear()
        return frames

    # ------------------------------------------------------------------ trio.abc.Stream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError("an in-process link carries frames, not bytes")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError("an in-process link carries frames, not bytes")

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self._hang_up()

    async def aclose(self) -> None:
        self._closed = True
        self._inbox.clear()
        self._wake.set()
        self._hang_up()
        await trio.lowlevel.checkpoint()

    def _hang_up(self) -> None:
        peer = self._peer
        if peer is not None:
            peer._eof = True
            peer._wake.set()


def local_stream_pair() -> tuple[LocalStream, LocalStream]:
    """``(client end, serving end)`` of a new in-process link: the serving end copies the
    payloads it sends (answers), the client end hands its payloads over by reference."""
    client = LocalStream(copy_payloads=False)
    server = LocalStream(copy_payloads=True)
    client._peer, server._peer = server, client
    return client, server


def _payload_view(payload: Payload | None, *, copy: bool) -> memoryview:
    if payload is None:
        return _EMPTY
    if isinstance(payload, (bytes, bytearray, memoryview)):
        if copy:
            return memoryview(bytes(payload))
        return memoryview(payload).toreadonly()
    parts: list[Any] = list(payload)
    if not parts:
        return _EMPTY
    if len(parts) == 1 and not copy:
        return memoryview(parts[0]).toreadonly()
    return memoryview(b"".join(parts))
