"""Replication policies: what they must offer, the built-in ``quorum`` policy, and the
building blocks a policy plugin uses.

* :class:`ReplicationPolicy` and :class:`SegmentWriter` — the protocols the broker's
  managed ledger and auditor are written against; a policy registered through
  ``pigeon_replication_policies`` follows them (it need not inherit from anything);
  :class:`WriterOptions`, :class:`ReadOptions` and :class:`RecoverOptions` are the
  keyword options of its methods.
* :class:`PolicyBase` — what the shipped policies share (quorum sizes, the choice of an
  ensemble, reads and recovery of a fragment given its Qw, :class:`ReplicaRepairs` of
  damaged copies) and :class:`WriterBase` what their writers do (close, abort, wait
  until idle); :class:`QuorumPolicy` and its :class:`QuorumWriter` — BookKeeper's
  protocol.
* :class:`BookieClient` — the connections to bookies a policy is built with.
* :func:`read_replicas`, :func:`read_striped`, :func:`recover_segment`,
  :func:`fail_in_order` — reads that pass over damaged copies, fence-and-recover of a
  segment whose writer died, and in-order failure of the entries in flight.

:class:`pigeon.core.testing.ReplicationPolicyContract` is the suite a policy runs
against itself; ``pigeon-leader-follower`` is a complete example.
"""

from __future__ import annotations

from pigeon.core import _replication
from pigeon.core._bookie_client import BookieClient
from pigeon.core._policy import (
    BookieLoad,
    ReadOptions,
    RecoverOptions,
    ReplaceBookie,
    ReplicationPolicy,
    SegmentWriter,
    WriteCallback,
    WriterOptions,
)
from pigeon.core._replication import (
    PolicyBase,
    QuorumPolicy,
    QuorumWriter,
    ReplicaRepairs,
    WriterBase,
    fail_in_order,
    read_replicas,
    read_striped,
    recover_segment,
)

__all__ = [
    "BookieClient",
    "BookieLoad",
    "PolicyBase",
    "QuorumPolicy",
    "QuorumWriter",
    "ReadOptions",
    "RecoverOptions",
    "ReplaceBookie",
    "ReplicaRepairs",
    "ReplicationPolicy",
    "SegmentWriter",
    "WriteCallback",
    "WriterBase",
    "WriterOptions",
    "add_entry_timeout",
    "fail_in_order",
    "read_replicas",
    "read_striped",
    "recover_segment",
]


def add_entry_timeout() -> float:
    """Seconds a bookie may leave an add unanswered before a writer counts it as failed.

    Read at each call, not copied at import, so that a test that shortens the timeout
    (``monkeypatch.setattr("pigeon.core._replication.ADD_ENTRY_TIMEOUT_S", 1.0)``) moves
    every writer's, the plugins' included."""
    return _replication.ADD_ENTRY_TIMEOUT_S
