"""ProducerAccess: who may produce on a topic, per access mode (no I/O)."""

from __future__ import annotations

import pytest

from pigeon.broker._access import MustWait, ProducerAccess
from pigeon.core.errors import ProducerBusy, ProducerFenced


def test_shared_producers_coexist_until_one_is_exclusive() -> None:
    access = ProducerAccess("t")
    assert access.admit("a", "shared", -1, []).epoch == 0
    assert access.admit("b", "shared", -1, ["a"]).epoch == 0
    with pytest.raises(ProducerBusy, match="has 2 connected producers"):
        access.admit("x", "exclusive", -1, ["a", "b"])


def test_an_exclusive_producer_keeps_everyone_else_out() -> None:
    access = ProducerAccess("t")
    admitted = access.admit("x", "exclusive", -1, [])
    assert (admitted.epoch, admitted.raised) == (1, True)
    for mode in ("shared", "exclusive"):
        with pytest.raises(ProducerBusy, match="already has an exclusive producer"):
            access.admit("y", mode, -1, ["x"])
    # its own re-attach keeps the epoch
    again = access.admit("x", "exclusive", 1, [])
    assert (again.epoch, again.raised) == (1, False)
    access.released("x")
    assert access.admit("y", "shared", -1, []).epoch == 1


def test_waiters_go_first_come_first_served() -> None:
    access = ProducerAccess("t")
    access.admit("x", "exclusive", -1, [])
    waits = []
    for name in ("w1", "w2"):
        with pytest.raises(MustWait) as waiting:
            access.admit(name, "wait_for_exclusive", -1, ["x"])
        waits.append(waiting.value.ticket)
    assert access.released("x")
    with pytest.raises(ProducerBusy, match="waiting for exclusive access"):
        access.admit("s", "shared", -1, [])
    with pytest.raises(MustWait):  # not its turn
        access.admit("w2", "wait_for_exclusive", -1, [], waits[1])
    assert access.admit("w1", "wait_for_exclusive", -1, [], waits[0]).epoch == 2
    access.released("w1")
    assert access.admit("w2", "wait_for_exclusive", -1, [], waits[1]).epoch == 3


def test_fencing_removes_the_others_and_they_stay_fenced() -> None:
    access = ProducerAccess("t", epoch=4)  # the epoch a previous owner persisted
    access.admit("x", "exclusive", 4, [])  # re-attached after a move: it wins
    admitted = access.admit("f", "exclusive_with_fencing", -1, ["x", "s"])
    assert (admitted.epoch, set(admitted.fence)) == (5, {"x", "s"})
    with pytest.raises(ProducerFenced):
        access.admit("x", "exclusive", 4, [])
    with pytest.raises(ProducerFenced):
        access.admit("s", "shared", 0, [])
    access.released("f")
    with pytest.raises(ProducerFenced):  # a stale epoch, whoever holds the topic
        access.admit("x", "exclusive", 4, [])
    assert access.admit("s2", "shared", -1, []).epoch == 5
