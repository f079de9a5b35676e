"""A producer's link to its topic: attach, send, receipts, re-attach. No I/O.

:class:`ProducerLink` decides what the trio :class:`~pigeon.client._engine.ProducerEngine`
sends and when; the engine only moves bytes and reports back what happened.

States::

    DETACHED --begin_attach--> ATTACHING --attach_succeeded--> ATTACHED
        ^                          |                               |
        +------ attach_failed -----+                               |
        +-- retriable send error, closedByBroker, connection lost -+

Every attach starts a new *attachment* (``epoch``); the engine tags each send with the
epoch it went out on and reports every answer with it.  The rules that keep every
acknowledged message stored (DESIGN.md §13):

* nothing is sent on an attachment that is not ``ATTACHED``, and on one attachment
  batches go out once each, in submission (= sequence) order;
* ``attach_succeeded`` hands back every batch still waiting for its receipt, oldest
  first, and only then do new batches go out: the broker never sees a newer batch of this
  producer before an older one on a fresh attachment, so its de-duplication (which
  answers ``duplicate`` for a sequence id at or below the highest it stored) can only
  ever answer ``duplicate`` for a batch that really was stored;
* any retriable error on a send of the current attachment (the broker could not store
  it), a ``closedByBroker`` or a lost connection detaches: later batches already in
  flight on that attachment may have been refused too, so after the re-attach *all*
  waiting batches are sent again from the oldest (the broker de-duplicates the ones it
  did store and answers their receipts);
* retriable errors from an attachment the producer has left are ignored (the batch is
  sent again anyway); a receipt counts whichever attachment brings it (the batch is
  stored), and so does a permanent refusal (the batch must never be sent again: once a
  newer batch is stored, the broker would answer it ``duplicate``);
* batches complete (their callback runs) strictly in submission order: a receipt that
  arrives while an older batch still waits is kept until the older one completes;
  a batch completes exactly once (success, its permanent error, a timeout or the close).
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from typing import Any

from pigeon.core.errors import PigeonError, Timeout

__all__ = ["LinkState", "ProducerLink"]


class LinkState(enum.Enum):
    DETACHED = "detached"
    ATTACHING = "attaching"
    ATTACHED = "attached"


def is_retriable(error: BaseException) -> bool:
    """Does this error on a send mean "not stored, send again after a re-attach"?"""
    return isinstance(error, PigeonError) and error.retriable


class ProducerLink:
    """Pending batches of one producer and the attach state machine (see module doc).

    Batches are :class:`~pigeon.client._engine.PendingBatch` objects; the link sets their
    ``order`` (submission number) and ``outcome`` and calls their ``callback`` when they
    complete.
    """

    def __init__(self) -> None:
        self.state = LinkState.DETACHED
        self.epoch = 0
        #: batches not yet completed, by submission number (oldest first)
        self.pending: OrderedDict[int, Any] = OrderedDict()
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self.pending)

    def can_send(self, epoch: int) -> bool:
        return self.state is LinkState.ATTACHED and epoch == self.epoch

    # -- batches -----------------------------------------------------------------------

    def submit(self, batch: Any, refused: BaseException | None = None) -> bool:
        """Record a sealed batch; True: send it now on attachment ``self.epoch``.

        ``refused``: the batch cannot be sent at all (it failed to build, or it is over
        the broker's size limit); it fails with this error in its turn.
        """
        batch.order = next(self._order)
        batch.outcome = None if refused is None else (None, refused)
        self.pending[batch.order] = batch
        if refused is not None:
            self._complete_ready()
            return False
        return self.state is LinkState.ATTACHED

    def on_result(self, epoch: int, batch: Any, result: Any, error: BaseException | None) -> bool:
        """The broker answered a send of ``batch`` made on ``epoch``.

        Returns True when the producer has just become detached and must re-attach.
        """
        if not self._waiting(batch):
            return False  # completed already (a duplicate answer, a timeout, the close)
        if error is None:
            batch.outcome = (result, None)  # stored, whichever attachment says so
        elif is_retriable(error):
            if not self.can_send(epoch):
                return False  # an attachment we left: the batch is (or will be) sent again
            self.state = LinkState.DETACHED
            return True
        else:
            # Refused for good (too large, blocked by a quota, corrupt), whichever
            # attachment says so: sending it again after a newer batch was stored would
            # be answered "duplicate".
            batch.outcome = (None, error)
        self._complete_ready()
        return False

    def _waiting(self, batch: Any) -> bool:
        """Is ``batch`` pending and without an outcome yet?"""
        return batch.outcome is None and self.pending.get(batch.order) is batch

    def expire(self, before: float, timeout: float) -> int:
        """Fail (with Timeout) the batches created before ``before``; how many."""
        n = 0
        for batch in self.pending.values():
            if batch.outcome is None and batch.created < before:
                batch.outcome = (None, Timeout(f"send timed out after {timeout}s"))
                n += 1
        if n:
            self._complete_ready()
        return n

    def fail_all(self, error: BaseException) -> None:
        """Complete everything: batches with a receipt succeed, the others fail."""
        for batch in self.pending.values():
            if batch.outcome is None:
                batch.outcome = (None, error)
        self._complete_ready()

    def _complete_ready(self) -> None:
        pending = self.pending
        while pending:
            order, batch = next(iter(pending.items()))
            if batch.outcome is None:
                return
            del pending[order]
            result, error = batch.outcome
            batch.callback(result, error)

    # -- attachment --------------------------------------------------------------------

    def begin_attach(self) -> int:
        """A (re-)attach starts; returns its epoch. Whatever was attached is left."""
        self.epoch += 1
        self.state = LinkState.ATTACHING
        return self.epoch

    def attach_succeeded(self, epoch: int) -> list[Any] | None:
        """The producer was created for ``epoch``: the batches to send first, in order.

        None if that attach is stale (a newer one started, or it was given up).
        """
        if epoch != self.epoch or self.state is not LinkState.ATTACHING:
            return None
        self.state = LinkState.ATTACHED
        return [b for b in self.pending.values() if b.outcome is None]

    def attach_failed(self, epoch: int) -> None:
        if epoch == self.epoch and self.state is LinkState.ATTACHING:
            self.state = LinkState.DETACHED

    def detach(self, epoch: int) -> bool:
        """The attachment ``epoch`` is gone (connection lost, closedByBroker).

        True when this detached the producer (it must re-attach).  While a re-attach is
        under way it is ignored: it concerns the attachment left before.
        """
        if self.can_send(epoch):
            self.state = LinkState.DETACHED
            return True
        return False
