"""Producer access modes of a topic (Pulsar's ProducerAccessMode), without I/O.

:class:`ProducerAccess` decides whether a producer may attach and what it does to the
others; the topic keeps one and :meth:`pigeon.broker._service.BrokerService.create_producer`
acts on its answers (waits, fences, persists the epoch).

* ``shared`` (the default): any number of producers, while no producer holds the topic
  exclusively and none waits for it (ProducerBusy otherwise).
* ``exclusive``: the only producer; ProducerBusy if another is connected.
* ``wait_for_exclusive``: as ``exclusive``, but instead of failing it waits, first come
  first served, until the topic is free.
* ``exclusive_with_fencing``: the only producer; every other connected producer is fenced
  (its sends fail with ProducerFenced, and it cannot re-attach under the same name while
  this broker remembers it).

The **epoch** orders exclusive owners: every new producer of an exclusive mode raises it
(the broker persists it with the topic before answering), and each producer learns it in
``producerCreated``.  A re-attaching producer of an exclusive mode presents its epoch; one
below the topic's is fenced: another exclusive producer took the topic since (on whatever
broker owns it now, so "the first to reconnect wins" after a move, and a fenced producer
stays fenced).  Shared producers carry no epoch claim; a fenced shared producer is
remembered by name (in memory, at most :data:`MAX_FENCED` names).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass

from pigeon.core.errors import InvalidArgument, ProducerBusy, ProducerFenced

__all__ = ["ACCESS_MODES", "Admission", "MustWait", "ProducerAccess", "wire_access_mode"]

ACCESS_MODES = ("shared", "exclusive", "wait_for_exclusive", "exclusive_with_fencing")
_WIRE = {
    "shared": "shared",
    "exclusive": "exclusive",
    "waitForExclusive": "wait_for_exclusive",
    "exclusiveWithFencing": "exclusive_with_fencing",
}
#: fenced producer names remembered per topic (the oldest are forgotten first)
MAX_FENCED = 1024


def wire_access_mode(wire: str) -> str:
    """The access mode of a ``CreateProducer.accessMode`` enum name."""
    try:
        return _WIRE[wire]
    except KeyError:
        raise InvalidArgument(f"unknown producer access mode {wire!r}") from None


@dataclass(frozen=True)
class Admission:
    """A producer may attach: with this topic ``epoch``; ``fence`` names the connected
    producers it removes; ``raised``: the epoch went up (persist it before answering)."""

    epoch: int
    fence: tuple[str, ...] = ()
    raised: bool = False


class MustWait(Exception):
    """``wait_for_exclusive``: not yet; ask again once :attr:`ProducerAccess.changed` said
    so.  ``ticket`` is the waiter's place in line (pass it back, or to ``leave``)."""

    def __init__(self, ticket: object) -> None:
        super().__init__("waiting for exclusive access")
        self.ticket = ticket


class ProducerAccess:
    """Who may produce on one topic (see the module docstring)."""

    def __init__(self, topic: str, epoch: int = 0) -> None:
        self.topic = topic
        self.epoch = epoch
        #: the producer name holding the topic exclusively, if any
        self.exclusive: str | None = None
        #: wait_for_exclusive tickets, first come first served
        self.waiting: deque[object] = deque()
        self.fenced: OrderedDict[str, int] = OrderedDict()

    def admit(
        self,
        name: str,
        mode: str,
        epoch: int,
        connected: Collection[str],
        ticket: object | None = None,
    ) -> Admission:
        """May producer ``name`` attach in ``mode``?  ``epoch``: the one it was given
        before (a re-attach), -1 for a new producer; ``connected``: the names of the other
        producers attached now.  Raises ProducerBusy, ProducerFenced, or MustWait."""
        known = epoch >= 0
        fenced_at = self.fenced.get(name)
        if known and fenced_at is not None and epoch < fenced_at:
            raise ProducerFenced(
                f"producer {name!r} was fenced on {self.topic} by an exclusive producer"
                f" (topic epoch {fenced_at})"
            )
        if mode == "shared":
            self._check_not_held(name)
            if self.waiting:
                raise ProducerBusy(f"topic {self.topic} has producers waiting for exclusive access")
            return Admission(self.epoch)
        if known and epoch < self.epoch:
            raise ProducerFenced(
                f"producer {name!r} was fenced on {self.topic}: the topic epoch is"
                f" {self.epoch}, the producer's {epoch}"
            )
        if mode == "exclusive_with_fencing":
            self._leave(ticket)
            fence = tuple(n for n in connected if n != name)
            for n in fence:
                self._remember_fenced(n)
            taken = self._take(name, known)
            return Admission(taken.epoch, fence, taken.raised)
        if mode not in ACCESS_MODES:
            raise InvalidArgument(f"unknown producer access mode {mode!r}")
        try:
            self._check_not_held(name)
            others = [n for n in connected if n != name]
            if others:
                raise ProducerBusy(
                    f"topic {self.topic} has {len(others)} connected producer"
                    f"{'s' if len(others) > 1 else ''}: exclusive access refused"
                )
            if self.waiting and self.waiting[0] is not ticket:
                raise ProducerBusy(f"topic {self.topic} has producers waiting for exclusive access")
        except ProducerBusy:
            if mode != "wait_for_exclusive":
                raise
            if ticket is None:
                ticket = object()
                self.waiting.append(ticket)
            raise MustWait(ticket) from None
        self._leave(ticket)
        return self._take(name, known)

    def _check_not_held(self, name: str) -> None:
        if self.exclusive is not None and self.exclusive != name:
            raise ProducerBusy(f"topic {self.topic} already has an exclusive producer")

    def _take(self, name: str, known: bool) -> Admission:
        raised = not known
        if raised:
            self.epoch += 1
        self.exclusive = name
        self.fenced.pop(name, None)
        return Admission(self.epoch, raised=raised)

    def _remember_fenced(self, name: str) -> None:
        if self.exclusive == name:
            self.exclusive = None
        self.fenced[name] = self.epoch + 1
        self.fenced.move_to_end(name)
        while len(self.fenced) > MAX_FENCED:
            self.fenced.popitem(last=False)

    def state(self) -> tuple[str | None, dict[str, int]]:
        """Who holds the topic and who is fenced, to :meth:`undo` an admission with."""
        return self.exclusive, dict(self.fenced)

    def undo(
        self, name: str, admission: Admission, before: tuple[str | None, dict[str, int]]
    ) -> None:
        """The admission of ``name`` was not completed (its epoch could not be stored):
        the producers it would have fenced are not, whoever held the topic holds it
        again (the epoch stays raised: epochs only go up)."""
        exclusive, fenced = before
        for n in admission.fence:
            if n in fenced:
                self.fenced[n] = fenced[n]
            else:
                self.fenced.pop(n, None)
        if self.exclusive == name:
            self.exclusive = exclusive

    def leave(self, ticket: object) -> None:
        """A waiter gave up (its client closed it, or the topic went away)."""
        self._leave(ticket)

    def _leave(self, ticket: object | None) -> None:
        if ticket is not None:
            try:
                self.waiting.remove(ticket)
            except ValueError:
                pass

    def released(self, name: str) -> bool:
        """Producer ``name`` left; True if a waiter should look again."""
        if self.exclusive == name:
            self.exclusive = None
        return bool(self.waiting)
