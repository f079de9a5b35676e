"""``concurrent.futures.Future`` per message at the cost of one small object.

A plain ``Future`` builds a ``threading.Condition`` (and an ``RLock``) in its constructor,
which costs more than everything else a producer does per message.  A
:class:`MessageFuture` is a real ``Future`` subclass (``result``, ``done``,
``add_done_callback``, ``concurrent.futures.wait``/``as_completed`` all work) whose state
lives in the :class:`BatchState` it shares with the other messages of its batch: one
condition per batch, resolved once per batch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures._base import FINISHED, PENDING
from typing import Any

from pigeon.client._message import MessageId, receipt_message_id

__all__ = ["BatchState", "MessageFuture"]

log = logging.getLogger(__name__)


class BatchState:
    """Outcome of one batch, shared by the futures of its messages."""

    __slots__ = ("condition", "exception", "partition", "receipt", "state", "watched")

    def __init__(self, partition: int) -> None:
        self.condition = threading.Condition()  # RLock: wait() locks every future of a batch
        self.state = PENDING
        self.receipt: tuple[int, int, int, bool] | None = None
        self.exception: BaseException | None = None
        self.partition = partition
        self.watched: list[MessageFuture] = []

    def resolve(self, receipt: Any, exception: BaseException | None) -> None:
        with self.condition:
            self.receipt = receipt
            self.exception = exception
            self.state = FINISHED
            watched = list(self.watched)
            for f in watched:
                for waiter in f._wts or ():
                    if exception is None:
                        waiter.add_result(f)
                    else:
                        waiter.add_exception(f)
            self.condition.notify_all()
        for f in watched:
            for fn in f._cbs or ():
                try:
                    fn(f)
                except Exception:
                    log.exception("exception calling callback for %r", f)


class MessageFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """Future of one message's MessageId; its state is the batch's."""

    # slots, not the instance dict (which Future's instances have): one less object per
    # message (pigeon.client._speedups sets these two by their offsets)
    __slots__ = ("_batch", "_index")

    #: the callbacks and waiters of this future, once it has any (class defaults: an
    #: instance sets them only then, so making one sets two attributes)
    _cbs: list[Any] | None = None
    _wts: list[Any] | None = None

    def __init__(self, batch: BatchState, index: int) -> None:  # no super().__init__: no Condition
        self._batch = batch
        self._index = index

    # The base class reads these attributes; they all come from the shared batch state.
    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        return self._batch.condition

    @property
    def _state(self) -> str:
        return self._batch.state

    @_state.setter
    def _state(self, value: str) -> None:  # only cancel paths would set it; we refuse those
        pass

    @property
    def _result(self) -> MessageId | None:  # type: ignore[override]
        r = self._batch.receipt
        if r is None:
            return None
        return receipt_message_id(r, self._index, self._batch.partition)

    @property
    def _exception(self) -> BaseException | None:  # type: ignore[override]
        return self._batch.exception

    def _watch(self) -> None:
        if self._cbs is None and self._wts is None:
            self._batch.watched.append(self)

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        if self._wts is None:
            self._watch()
            self._wts = []
        return self._wts

    @property
    def _done_callbacks(self) -> list[Any]:
        if self._cbs is None:
            self._watch()
            self._cbs = []
        return self._cbs

    def cancel(self) -> bool:
        """A message handed to the producer cannot be taken back."""
        return False

    def __repr__(self) -> str:
        return f"<MessageFuture state={self._batch.state} index={self._index}>"
