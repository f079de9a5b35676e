"""A harness for fuzzing a real server over loopback with hostile bytes, from
synchronous hypothesis tests.

* :func:`fuzz_settings`: the hypothesis settings of a fuzz run (bounded and derandomized
  unless an environment variable asks for more examples).
* :class:`ServerThread`: a trio run on a background thread serving something (override
  :meth:`ServerThread.serve`), started and stopped from a synchronous test.
* :class:`RawConnection`: a blocking socket speaking frames, to send bytes no real client
  would; :func:`frame_bytes` builds one valid frame.
* :func:`flipped_frames` and :func:`hostile_bytes`: hypothesis strategies of bit-flipped
  valid requests, truncated frames and random bytes; :func:`run_fuzz` sends each example.
* :func:`check_exchange`: after hostile bytes, every answer is a valid one or a typed
  error (never an internal one) and a probe request is still answered, unless the server
  hung up after saying why (or is still waiting for the rest of a frame);
  :class:`ErrorLines`: the ERROR lines and tracebacks the ``pigeon`` loggers wrote (the
  ``error_lines`` fixture of the ``pigeon.core.testing`` plugin).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import hypothesis
import pytest
import trio
from hypothesis import strategies as st

from pigeon.core._framing import (
    FrameDecoder,
    build_message,
    capnp_message_size,
    encode_frame,
    sniff_foreign_protocol,
)
from pigeon.core.errors import InternalError, PigeonError

__all__ = [
    "START_TIMEOUT",
    "ErrorLines",
    "Frame",
    "RawConnection",
    "Request",
    "ServerThread",
    "check_exchange",
    "error_lines",
    "flipped_frames",
    "frame_bytes",
    "fuzz_settings",
    "hostile_bytes",
    "run_fuzz",
    "server_waits",
]

#: how long a :class:`ServerThread` may take to start or stop
START_TIMEOUT = 30.0

#: a valid request to mutate: (kind, fields, payload)
Request = tuple[str, dict[str, Any] | None, bytes | None]
#: a frame a :class:`RawConnection` received: (request id, kind, error code, detail)
Frame = tuple[int, str, int | None, Any]


def fuzz_settings(variable: str = "PIGEON_FUZZ_EXAMPLES", default: int = 60) -> hypothesis.settings:
    """Hypothesis settings of a fuzz run: ``default`` examples, derandomized, unless the
    environment variable ``variable`` asks for a number (then randomized); no deadline, no
    example database, no health check."""
    examples = os.environ.get(variable)
    return hypothesis.settings(
        max_examples=int(examples or default),
        deadline=None,
        derandomize=examples is None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )


class ErrorLines:
    """The ERROR lines, and the lines with a traceback, that the ``pigeon.*`` loggers wrote
    while the test set up and ran, as ``caplog`` caught them (from any thread)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    @property
    def records(self) -> list[logging.LogRecord]:
        return [
            r
            for when in ("setup", "call")
            for r in self._caplog.get_records(when)
            if r.name.partition(".")[0] == "pigeon" and (r.levelno >= logging.ERROR or r.exc_info)
        ]

    def assert_none(self) -> None:
        assert not self.records, [r.getMessage() for r in self.records]


@pytest.fixture
def error_lines(caplog: pytest.LogCaptureFixture) -> ErrorLines:
    """What the ``pigeon`` loggers report as errors while the test sets up and runs."""
    return ErrorLines(caplog)


class ServerThread:
    """A trio run on a background thread, so that synchronous tests (raw sockets, click's
    CliRunner, HTTP clients) can talk to what it serves over loopback.

    Subclasses override :meth:`serve`; :meth:`start` returns once it has returned, and
    :meth:`stop` cancels the run.  A failure to start or a crash is raised by
    :meth:`start` or :meth:`stop` as an :class:`AssertionError`."""

    def __init__(self, name: str) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def serve(self, nursery: trio.Nursery) -> None:
        """Start the servers in ``nursery`` (they run until :meth:`stop`)."""
        raise NotImplementedError

    def start(self) -> Any:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise AssertionError(f"{self._thread.name} did not start in time")
        if self._error is not None:
            raise AssertionError(f"{self._thread.name} failed to start: {self._error!r}") from (
                self._error
            )
        return self

    def stop(self) -> None:
        if self._token is not None and self._cancel is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(START_TIMEOUT)
        assert not self._thread.is_alive(), f"{self._thread.name} did not stop"
        if self._error is not None:
            raise AssertionError(f"{self._thread.name} crashed: {self._error!r}") from self._error

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await fn(*args)`` in the server's trio run (e.g. to look at its state)."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start()/stop()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await self.serve(nursery)
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()


def frame_bytes(
    frame_type: Any, kind: str, fields: Any, request_id: int, payload: bytes | None = None
) -> bytes:
    """One valid frame (length prefix, Cap'n Proto message, payload) of ``frame_type``."""
    message = build_message(frame_type, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message, payload))


class RawConnection:
    """A blocking socket speaking ``frame_type`` frames, to send bytes no real client
    would.  Every frame received is kept in :attr:`frames`; ``detail(message, payload)``,
    if given, says what else of one to keep (the fourth item of a :data:`Frame`)."""

    def __init__(
        self,
        address: tuple[str, int],
        frame_type: Any,
        detail: Callable[[Any, bytes], Any] | None = None,
    ) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.frame_type = frame_type
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.closed = False
        self._detail = detail

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, kind: str, fields: Any, request_id: int, payload: bytes | None = None) -> bytes:
        return frame_bytes(self.frame_type, kind, fields, request_id, payload)

    def _receive(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return
        self.decoder.feed(data)
        for frame in self.decoder.frames():
            size = capnp_message_size(frame)
            with self.frame_type.from_bytes(frame[:size]) as msg:
                kind = msg.which()
                code = msg.error.code if kind == "error" else None
                detail = self._detail(msg, bytes(frame[size:])) if self._detail else None
                self.frames.append((msg.requestId, kind, code, detail))

    def wait_for(self, request_id: int, timeout: float = 10.0) -> Frame:
        """The answer to ``request_id``; :class:`TimeoutError` if none came in time or the
        server hung up."""
        deadline = time.monotonic() + timeout
        while True:
            for frame in self.frames:
                if frame[0] == request_id:
                    return frame
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                raise TimeoutError(f"no answer to {request_id}: {self.frames}")
            self._receive(left)

    def request(
        self, kind: str, fields: Any, request_id: int, payload: bytes | None = None
    ) -> Frame:
        """Send one valid request and return its answer, which is not an error."""
        self.send(self.frame(kind, fields, request_id, payload))
        answer = self.wait_for(request_id)
        assert answer[1] != "error", (kind, answer)
        return answer


def server_waits(data: bytes) -> bool:
    """Whether a server framing ``data`` is left waiting for the rest of a frame (a
    mutated length prefix promised more bytes than were sent)."""
    decoder = FrameDecoder()
    decoder.feed(data)
    try:
        for _frame_bytes in decoder.frames():
            pass
    except PigeonError:
        return False  # it refuses the stream instead
    return decoder.buffered > 0


def check_exchange(
    conn: RawConnection,
    data: bytes,
    probe: tuple[str, Any],
    probe_id: int,
    *,
    answers: Collection[str],
    probe_answer: str,
) -> None:
    """Send ``data`` on ``conn`` (attached as the test needs), then the valid request
    ``probe`` (kind, fields) as ``probe_id``, and check everything that came back: only
    ``answers`` kinds, typed errors that are not internal ones, and the probe answered
    with ``probe_answer`` unless the server hung up after saying why (or a foreign
    protocol) or is still waiting for the rest of a frame."""
    conn.send(data)
    probe_frame = conn.frame(*probe, probe_id)
    waits = server_waits(data + probe_frame)
    if not conn.closed:
        try:
            conn.send(probe_frame)
        except OSError:
            conn.closed = True
    try:
        answer: Frame | None = conn.wait_for(probe_id, timeout=0.05 if waits else 10.0)
    except TimeoutError:
        answer = None
    for request_id, kind, code, _detail in conn.frames:
        assert kind in answers, kind
        if kind == "error":
            assert code in PigeonError._by_code, f"untyped error code {code}"
            assert code != InternalError.code, f"internal error answering {request_id}"
    if answer is not None:
        assert answer[1] == probe_answer, answer  # still serving valid requests
    elif conn.closed:  # the server hung up: it said why first, unless not our protocol
        said_why = any(kind == "error" for _rid, kind, _c, _d in conn.frames)
        assert said_why or sniff_foreign_protocol(data) is not None, conn.frames
    else:  # neither answered nor closed: only while a frame is incomplete
        assert waits, f"probe unanswered: {conn.frames}"


def flipped_frames(
    frame_type: Any, requests: Sequence[Request], *, keep_prefix: bool
) -> st.SearchStrategy[bytes]:
    """One of ``requests`` (request id in [2**16, 2**20]) with one to three bits flipped,
    in the length prefix too unless ``keep_prefix``."""

    @st.composite
    def flipped(draw: st.DrawFn) -> bytes:
        kind, fields, payload = draw(st.sampled_from(requests))
        request_id = draw(st.integers(2**16, 2**20))
        frame = bytearray(frame_bytes(frame_type, kind, fields, request_id, payload))
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(4 if keep_prefix else 0, len(frame) - 1))
            frame[at] ^= 1 << draw(st.integers(0, 7))
        return bytes(frame)

    return flipped()


def hostile_bytes(frame_type: Any, requests: Sequence[Request]) -> st.SearchStrategy[bytes]:
    """Bit flips anywhere in one of ``requests``, one of them truncated (or cut short
    behind an honest length prefix), random bytes and random bytes with a length prefix."""

    @st.composite
    def truncated(draw: st.DrawFn) -> bytes:
        kind, fields, payload = draw(st.sampled_from(requests))
        frame = frame_bytes(frame_type, kind, fields, draw(st.integers(2**16, 2**20)), payload)
        cut = draw(st.integers(5, len(frame) - 1))
        if draw(st.booleans()):
            return struct.pack("<I", cut - 4) + frame[4:cut]  # a short Cap'n Proto message
        return frame[:cut]

    junk = st.binary(min_size=1, max_size=200)
    framed_junk = junk.map(lambda b: struct.pack("<I", len(b)) + b)
    return (
        flipped_frames(frame_type, requests, keep_prefix=False) | truncated() | junk | framed_junk
    )


def run_fuzz(
    settings: hypothesis.settings,
    strategy: st.SearchStrategy[bytes],
    exchange: Callable[[bytes], None],
) -> None:
    """``exchange(data)`` for every example ``data`` of ``strategy``, with ``settings``
    (:func:`fuzz_settings`); the first failing example is shrunk and raised."""

    @settings
    @hypothesis.given(data=strategy)
    def run(data: bytes) -> None:
        exchange(data)

    run()
