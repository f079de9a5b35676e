"""The trio half of a producer: sends sealed batches and re-attaches, as its link decides.

The :class:`~pigeon.client._link.ProducerLink` keeps every sent-but-unacknowledged batch in
sequence order; after a re-attach they are all sent again, in order, under the same producer
name (the broker drops the ones it already stored), and no newer batch goes out on an old
connection while the producer re-attaches.  Each send is a :class:`SendRequest`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from pigeon.client._engine import ClientEngine, PendingBatch, Reconnecting
from pigeon.client._link import LinkState, ProducerLink
from pigeon.core.errors import AlreadyClosed, ConnectionClosed, MessageTooLarge, PigeonError
from pigeon.core.rpc import Connection

__all__ = ["ProducerEngine", "SendRequest"]

log = logging.getLogger(__name__)

_ACCESS_MODE_WIRE = {
    "shared": "shared",
    "exclusive": "exclusive",
    "wait_for_exclusive": "waitForExclusive",
    "exclusive_with_fencing": "exclusiveWithFencing",
}


class ProducerEngine(Reconnecting):
    """Trio half of a producer: moves batches as its :class:`ProducerLink` decides."""

    def __init__(
        self,
        engine: ClientEngine,
        topic: str,
        *,
        producer_name: str = "",
        send_timeout: float = 30.0,
        schema_info: dict[str, str] | None = None,
        access_mode: str = "shared",
    ) -> None:
        self.engine = engine
        #: the producer's schema as the wire carries it (None: bytes)
        self.schema_info = schema_info
        #: its version in the topic's registry (-1: no schema)
        self.schema_version = -1
        self.access_mode = access_mode
        #: the topic epoch the broker gave this producer (-1: not attached yet); sent
        #: back on a re-attach, so a producer fenced meanwhile learns it
        self.topic_epoch = -1
        self.topic = topic
        self.producer_name = producer_name
        self.send_timeout = send_timeout
        self.producer_id = engine.next_id()
        self.conn: Connection | None = None
        self.closed = False
        self.last_sequence_id = -1
        self.link = ProducerLink()
        self._reconnect = trio.Event()
        self._no_pending = trio.Event()
        self._no_pending.set()
        self.failure: PigeonError | None = None
        self.max_message_size = 5 * 1024 * 1024
        #: called (engine thread) when the last batch waiting for a receipt got it or
        #: failed: a producer without a batching delay seals the batch it held
        self.on_idle: Callable[[], None] | None = None

    async def start(self) -> None:
        # wait_for_exclusive: the broker answers once this producer has the topic
        waits = self.access_mode == "wait_for_exclusive"
        try:
            await self.engine.attach(self._attach, limit=math.inf if waits else None)
        except BaseException:
            conn = self.conn or self.engine._conns.get(self.engine.address)
            if conn is not None and not conn.closed:
                with contextlib.suppress(ConnectionClosed):
                    conn.send_nowait("closeProducer", {"producerId": self.producer_id})
            raise
        self.engine.producers[self.producer_id] = self
        self.engine.nursery.start_soon(self._keep_connected)
        if math.isfinite(self.send_timeout) and self.send_timeout > 0:
            self.engine.nursery.start_soon(self._expire_loop)

    def describe(self) -> str:
        return f"topic={self.topic} producer={self.producer_name or self.producer_id}"

    def _is_attached(self) -> bool:
        conn = self.conn
        return self.link.state is LinkState.ATTACHED and conn is not None and not conn.closed

    def _leave(self) -> None:
        self.link.detach(self.link.epoch)

    async def _attach(self) -> None:
        epoch = self.link.begin_attach()
        try:
            address, full, _n = await self.engine.lookup(self.topic)
            self.topic = full
            conn = await self.engine.connection(address)
            fields: dict[str, Any] = {
                "producerId": self.producer_id,
                "topic": full,
                "producerName": self.producer_name,
                "accessMode": _ACCESS_MODE_WIRE[self.access_mode],
                "topicEpoch": self.topic_epoch,
            }
            if self.schema_info is not None:
                fields["schemaInfo"] = self.schema_info
            if self.access_mode == "wait_for_exclusive":
                result = await conn.request("createProducer", fields, expect="producerCreated")
            else:
                result = await self.engine.request(
                    conn, "createProducer", fields, expect="producerCreated"
                )
        except BaseException:
            self.link.attach_failed(epoch)
            raise
        self.producer_name = result["producerName"]
        self.topic_epoch = result["topicEpoch"]
        self.max_message_size = result["maxMessageSize"]
        self.schema_version = result.get("schemaVersion", -1) if self.schema_info else -1
        if self.last_sequence_id < 0:
            self.last_sequence_id = result["lastSequenceId"]
        self.conn = conn
        batches = self.link.attach_succeeded(epoch)
        if batches:
            log.info(
                "producer attached topic=%s producer=%s resending=%d",
                self.topic,
                self.producer_name,
                len(batches),
            )
        for batch in batches or ():
            if not self._send(batch, epoch):
                break

    def _fatal(self, exc: PigeonError) -> None:
        super()._fatal(exc)
        self.failure = exc
        self.link.fail_all(exc)
        self._check_empty()

    def closed_by_broker(self, conn: Connection) -> None:
        """The broker closed this producer on ``conn``: re-attach (resending what waits)."""
        if conn is self.conn and self.link.detach(self.link.epoch):
            log.info("producer closed by broker %s", self.describe())
            self.reconnect_soon()

    def submit(self, batch: PendingBatch) -> None:
        """Send a sealed batch (engine thread). Its callback runs on the receipt."""
        if self.closed or self.failure is not None:
            batch.callback(None, self.failure or AlreadyClosed("producer is closed"))
            return
        refused = batch.error
        if refused is None and len(batch.payload) > self.max_message_size:
            refused = MessageTooLarge(
                f"batch of {len(batch.payload):,} bytes (header and messages) is over the"
                f" broker's max_message_size {self.max_message_size:,}"
            )
        batch.created = trio.current_time()
        if self._no_pending.is_set():
            self._no_pending = trio.Event()
        if self.link.submit(batch, refused):
            self._send(batch, self.link.epoch)
        self._check_empty()

    def _send(self, batch: PendingBatch, epoch: int) -> bool:
        """Send ``batch`` on attachment ``epoch``; False if the connection is gone."""
        conn = self.conn
        assert conn is not None and self.link.can_send(epoch)
        request = SendRequest(self, batch, epoch)
        try:
            conn.request_nowait(
                "send",
                request.create_request(),
                request,
                payload=batch.payload,
                expect="sendReceipt",
                extract=_extract_receipt,
            )
        except ConnectionClosed:
            if self.link.detach(epoch):
                self.reconnect_soon()
            return False
        return True

    def _check_empty(self) -> bool:
        """Whether no batch waits for its receipt (then ``flush`` may return)."""
        if self.link.pending:
            return False
        self._no_pending.set()
        return True

    def _answered(self) -> None:
        """A batch got its receipt or failed: if none is left waiting, say so."""
        if self._check_empty() and self.on_idle is not None:
            self.on_idle()

    async def _expire_loop(self) -> None:
        while not self.closed:
            await trio.sleep(min(1.0, self.send_timeout / 4))
            if self.link.expire(trio.current_time() - self.send_timeout, self.send_timeout):
                self._answered()

    async def flush(self) -> None:
        await self._no_pending.wait()

    async def close(self) -> None:
        if self.closed:
            return
        with trio.move_on_after(self.send_timeout if math.isfinite(self.send_timeout) else 30):
            await self.flush()
        self.closed = True
        self._reconnect.set()
        self.engine.producers.pop(self.producer_id, None)
        self.link.fail_all(AlreadyClosed("producer closed before the message was acknowledged"))
        self._check_empty()
        conn = self.conn
        if conn is not None and not conn.closed:
            try:
                await self.engine.request(conn, "closeProducer", {"producerId": self.producer_id})
            except PigeonError:
                pass


class SendRequest:
    """One ``send`` of a batch on one attachment (``epoch``) of its producer.

    The connection calls it with the broker's answer; the producer's :class:`ProducerLink`
    decides what the answer means (the batch is done, or the attachment is given up and the
    batch waits to be resent after the re-attach).
    """

    __slots__ = ("batch", "epoch", "producer")

    def __init__(self, producer: ProducerEngine, batch: PendingBatch, epoch: int) -> None:
        self.producer = producer
        self.batch = batch
        self.epoch = epoch

    def create_request(self) -> dict[str, Any]:
        batch = self.batch
        return {
            "producerId": self.producer.producer_id,
            "sequenceId": batch.sequence_id,
            "numMessages": batch.num_messages,
        }

    def __call__(self, receipt: Any, error: BaseException | None) -> None:
        if error is None:
            self.handle_response(receipt)
        else:
            self.handle_error(error)

    def handle_response(self, receipt: tuple[int, int, int, bool]) -> None:
        batch = self.batch
        last = batch.sequence_id + batch.num_messages - 1
        producer = self.producer
        if last > producer.last_sequence_id:
            producer.last_sequence_id = last
        self._outcome(receipt, None)

    def handle_error(self, error: BaseException) -> None:
        self._outcome(None, error)

    def _outcome(self, receipt: Any, error: BaseException | None) -> None:
        producer = self.producer
        if producer.link.on_result(self.epoch, self.batch, receipt, error):
            log.info(
                "producer detached topic=%s sequence=%d error=%s",
                producer.topic,
                self.batch.sequence_id,
                error,
            )
            producer.reconnect_soon()
        producer._answered()


def _extract_receipt(body: Any, payload: memoryview) -> tuple[int, int, int, bool]:
    return (body.segmentId, body.entryId, body.firstOffset, body.duplicate)
