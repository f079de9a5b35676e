"""The history checker and the fault schedule, on synthetic histories (no process)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from ._checker import check, gaps, longest_gap, longest_overlapping
from ._history import (
    AckReceipt,
    Attach,
    Delivery,
    Event,
    Fault,
    History,
    LogRecord,
    Position,
    Send,
    format_payload,
    parse_payload,
)
from ._nemesis import GAP, HOLD, METADATA_HOLD, plan


def pos(n: int, partition: int = -1) -> Position:
    return (partition, 1, n, 0)


def healthy(n: int = 10, *, topic: str = "a") -> History:
    """``n`` messages of p0, all acknowledged, stored once, delivered to one subscription
    (two consumers) and one reader, consumers attached with no backlog at the end."""
    h = History()
    h.subscriptions[topic] = [f"{topic}/shared"]
    h.readers[topic] = [f"{topic}/reader-0"]
    h.consumers_expected[f"{topic}/shared"] = 2
    for i in range(n):
        h.sends.append(Send(topic, "p0", i, invoked=i * 0.1, acked=i * 0.1 + 0.01, position=pos(i)))
        h.final_read.append(LogRecord(topic, (topic, "p0", i), pos(i), i, i))
        for group in (f"{topic}/shared", f"{topic}/reader-0"):
            h.deliveries.append(Delivery(i * 0.1, group, f"{group}/0", (topic, "p0", i), pos(i)))
    h.attach.append(Attach(5.0, topic, f"{topic}/shared", 2, 0))
    h.production_stopped = n * 0.1
    return h


def test_a_healthy_history_passes() -> None:
    r = check(healthy())
    assert r.ok, r.violations
    assert (r.acknowledged, r.lost, r.duplicates, r.unexpected, r.reordered) == (10, 0, 0, 0, 0)
    assert r.undelivered == {"a/shared": 0, "a/reader-0": 0}


def test_a_dumped_history_checks_the_same(tmp_path: Path) -> None:
    h = healthy()
    del h.final_read[3]
    h.attach.append(Attach(6.0, "a", "a/shared", 1, 4, ("a-shared-0",)))
    h.final_read_status = {"a": "idle"}
    h.receipts.append(AckReceipt(0.05, "a/shared", ("a", "p0", 0)))
    h.dump(tmp_path / "h.jsonl.gz")
    again = History.load(tmp_path / "h.jsonl.gz")
    assert check(again) == check(h)


def test_payloads_name_their_send() -> None:
    assert parse_payload(format_payload("p", "p2", 1234)) == ("p", "p2", 1234)
    assert len(format_payload("p", "p2", 1)) == 100
    assert parse_payload(b"garbage") is None
    assert parse_payload(b"x:y:notanumber:...") is None


def test_an_acknowledged_message_missing_from_the_log_is_lost() -> None:
    h = healthy()
    del h.final_read[3]
    r = check(h)
    assert r.lost == 1
    assert any(v.startswith("(a)") and "('a', 'p0', 3)" in v for v in r.violations)


def test_a_topic_that_cannot_be_read_is_unverified_not_lost() -> None:
    h = healthy()
    h.final_read = []
    h.final_read_status = {"a": "unreadable: subscribe failed: Timeout"}
    r = check(h)
    assert (r.lost, r.unverified) == (0, 10)
    assert any("could not be read to its end" in v for v in r.violations)


def test_a_read_that_stalled_before_the_end_of_the_log_is_unverified() -> None:
    h = healthy()
    del h.final_read[3:]
    h.final_read_status = {"a": "stalled: nemesis-a: read up to offset 3 of 10"}
    r = check(h)
    assert (r.lost, r.unverified) == (0, 7)
    assert not r.ok


def test_a_read_that_went_idle_counts_what_is_missing_as_lost() -> None:
    h = healthy()
    del h.final_read[3]
    h.final_read_status = {"a": "idle"}
    assert check(h).lost == 1


def test_a_failed_send_missing_from_the_log_is_not_lost() -> None:
    h = healthy()
    h.sends[3].acked, h.sends[3].position = None, None
    h.sends[3].failed, h.sends[3].error = 1.0, "Timeout"
    del h.final_read[3]
    r = check(h)
    assert r.ok, r.violations
    assert (r.failed, r.lost) == (1, 0)


def test_a_failed_send_found_in_the_log_is_indeterminate_not_unexpected() -> None:
    h = healthy()
    h.sends[3].acked, h.sends[3].position, h.sends[3].failed = None, None, 1.0
    r = check(h)
    assert r.ok, r.violations
    assert (r.indeterminate_stored, r.unexpected) == (1, 0)


def test_a_pending_send_is_counted() -> None:
    h = healthy()
    h.sends.append(Send("a", "p0", 10, invoked=1.0))
    assert check(h).pending == 1


def test_a_message_stored_twice_is_a_duplicate() -> None:
    h = healthy()
    h.final_read.append(LogRecord("a", ("a", "p0", 4), pos(99), 10, 10))
    r = check(h)
    assert r.duplicates == 1
    assert any(v.startswith("(c)") for v in r.violations)


def test_the_final_read_getting_one_stored_copy_twice_is_no_duplicate() -> None:
    h = healthy()
    h.final_read.append(LogRecord("a", ("a", "p0", 4), pos(4), 4, 10))
    r = check(h)
    assert r.ok, r.violations


def test_out_of_order_within_a_partition_is_reported() -> None:
    h = healthy()
    # offsets say seq 6 was stored before seq 5
    h.final_read[5] = LogRecord("a", ("a", "p0", 5), pos(5), 7, 5)
    h.final_read[6] = LogRecord("a", ("a", "p0", 6), pos(6), 5, 6)
    h.final_read[7] = LogRecord("a", ("a", "p0", 7), pos(7), 6, 7)
    r = check(h)
    assert r.reordered == 1
    assert any(v.startswith("(b)") for v in r.violations)


def test_order_is_per_partition_and_per_producer() -> None:
    h = History()
    h.production_stopped = 1.0
    # p0 alternates partitions, p1 interleaves: every partition keeps each producer's order
    offsets = {0: 0, 1: 0}
    for seq in range(6):
        for producer in ("p0", "p1"):
            part = seq % 2
            where = (part, 1, seq, int(producer[1]))
            h.sends.append(Send("p", producer, seq, 0.0, 0.1, where))
            h.final_read.append(
                LogRecord("p", ("p", producer, seq), where, offsets[part], len(h.final_read))
            )
            offsets[part] += 1
    r = check(h)
    assert r.ok, r.violations
    assert r.reordered == 0


def test_unexpected_messages_are_reported() -> None:
    h = healthy()
    h.final_read.append(LogRecord("a", None, pos(50), 50, 50, raw="b'junk'"))
    h.final_read.append(LogRecord("a", ("a", "p9", 0), pos(51), 51, 51))
    r = check(h)
    assert r.unexpected == 2
    assert not r.ok


def test_a_subscription_missing_a_message_is_undelivered() -> None:
    h = healthy()
    h.deliveries = [
        d for d in h.deliveries if not (d.subscription == "a/shared" and d.id == ("a", "p0", 2))
    ]
    r = check(h)
    assert r.undelivered["a/shared"] == 1
    assert any(v.startswith("(d) a/shared") for v in r.violations)


def test_a_reader_missing_a_message_is_undelivered() -> None:
    h = healthy()
    h.deliveries = [d for d in h.deliveries if d.subscription != "a/reader-0"]
    r = check(h)
    assert r.undelivered["a/reader-0"] == 10


def test_redeliveries_are_counted_not_failed() -> None:
    h = healthy()
    h.deliveries.append(Delivery(2.0, "a/shared", "a/shared/1", ("a", "p0", 1), pos(1), 1))
    r = check(h)
    assert r.ok, r.violations
    assert r.redelivered["a/shared"] == 1


@pytest.mark.parametrize(
    ("attach", "why"),
    [
        ([], "no report"),
        ([Attach(5.0, "a", "a/shared", 1, 0)], "1 of 2 consumers"),
        ([Attach(5.0, "a", "a/shared", 2, 2704)], "backlog of 2704"),
        # attached earlier, detached at the end: the last sample counts
        ([Attach(1.0, "a", "a/shared", 2, 0), Attach(5.0, "a", "a/shared", 0, 9)], "0 of 2"),
    ],
)
def test_a_detached_consumer_is_reported(attach: list[Attach], why: str) -> None:
    """Issue #12: "backlog 2,704, 0 consumers, for 16-48 s and more"."""
    h = healthy()
    h.attach = attach
    r = check(h)
    assert why in r.detached["a/shared"]
    assert any(v.startswith("(e) a/shared") for v in r.violations)


def test_how_long_a_subscription_was_short_of_consumers() -> None:
    h = healthy()
    h.attach = [
        Attach(1.0, "a", "a/shared", 2, 0),
        Attach(3.0, "a", "a/shared", 1, 5, ("a-shared-0",)),
        Attach(9.0, "a", "a/shared", 1, 50, ("a-shared-0",)),
        Attach(10.0, "a", "a/shared", 2, 0),
        Attach(12.0, "a", "a/shared", 0, 9),
        Attach(13.0, "a", "a/shared", 1, 9, ("a-shared-1",)),
    ]
    r = check(h)
    assert r.detached_longest["a/shared"] == 6.0
    assert "(attached: a-shared-1)" in r.detached["a/shared"]


def test_only_samples_after_the_drain_tell_the_end_state() -> None:
    h = healthy()
    h.attach = [Attach(1.0, "a", "a/shared", 2, 0)]
    h.drained_at = 4.0
    r = check(h)
    assert "no report" in r.detached["a/shared"]


def test_a_receipt_naming_another_position_is_wrong() -> None:
    h = healthy()
    h.sends[2].position = pos(7)
    r = check(h)
    assert r.wrong_receipts == 1
    assert any(v.startswith("(f)") for v in r.violations)


def test_a_lost_message_whose_receipt_names_another_message_is_a_wrong_receipt() -> None:
    """Seen under the nemesis: answered "duplicate" with the position of another entry."""
    h = healthy()
    h.sends.append(Send("a", "p1", 0, invoked=0.5, acked=0.6, position=pos(1)))
    r = check(h)
    assert (r.lost, r.wrong_receipts) == (1, 1)
    assert any(v.startswith("(f)") and "holds ('a', 'p0', 1)" in v for v in r.violations)


def test_a_receipt_without_position_is_counted() -> None:
    h = healthy()
    h.sends[2].position = (-1, -1, -1, 0)
    r = check(h)
    assert r.ok, r.violations
    assert r.receipts_without_position == 1


def test_the_issue_symptom_duplicate_receipt_but_never_stored_fails() -> None:
    """What issue #12 saw: acknowledged with a (-1, -1) receipt, never stored."""
    h = healthy()
    h.sends[4].position = (-1, -1, -1, 0)
    del h.final_read[4]
    r = check(h)
    assert (r.lost, r.receipts_without_position) == (1, 1)
    assert not r.ok


def test_gaps_and_unavailability() -> None:
    assert gaps([1.0, 2.0, 5.0], 0.0, 6.0) == [(0.0, 1.0), (1.0, 2.0), (2.0, 5.0), (5.0, 6.0)]
    assert longest_gap([1.0, 2.0, 5.0], 0.0, 6.0) == 3.0
    assert longest_gap([], 0.0, 4.0) == 4.0
    assert longest_gap([0.5], 1.0, 1.0) == 0.0
    intervals = gaps([1.0, 2.0, 5.0], 0.0, 6.0)
    # a fault at 4 s falls inside the 2 s -> 5 s gap: the whole gap counts
    assert longest_overlapping(intervals, 4.0, 4.5) == 3.0
    assert longest_overlapping(intervals, 5.5, 6.0) == 1.0


def test_write_unavailability_after_each_fault() -> None:
    h = History()
    ack_times = [0.1 * i for i in range(20)] + [5.0 + 0.1 * i for i in range(20)]
    for seq, t in enumerate(ack_times):
        h.sends.append(Send("a", "p0", seq, t - 0.01, t, pos(seq)))
    h.production_stopped = 7.0
    h.faults = [
        Fault("kill", "broker-0", 1.5, 3.0, started=1.8, healed=4.8),
        Fault("pause", "bookie-1", 6.0, 2.0, started=6.0, healed=6.9),
    ]
    r = check(h)
    assert r.longest_unavailable == pytest.approx(5.0 - 1.9)
    assert r.unavailable_after_fault["kill broker-0 @1.8s"] == pytest.approx(3.1)
    assert r.unavailable_after_fault["pause bookie-1 @6.0s"] == pytest.approx(0.1)
    assert r.faults == {"kill-broker": 1, "pause-bookie": 1}


def test_unavailability_of_one_topic_shows_even_when_others_write() -> None:
    h = healthy(20)
    for i in range(20):
        h.sends.append(Send("b", "p0", i, i * 0.1, 0.05 if i < 2 else None, pos(i)))
    h.subscriptions["b"], h.readers["b"] = [], []
    r = check(h)
    assert r.longest_unavailable_by_topic["a"] < 0.2
    assert r.longest_unavailable == r.longest_unavailable_by_topic["b"] > 1.5


def test_crashes_are_counted() -> None:
    h = healthy()
    h.events.append(Event(1.0, "crash", "broker-1 exit=1"))
    assert check(h).crashes == 1


def test_the_schedule_replays_from_its_seed() -> None:
    targets = {"bookies": ["bookie-0", "bookie-1", "bookie-2"], "brokers": ["broker-0"]}
    first = plan(42, 120, metadata_server=True, **targets)
    assert first == plan(42, 120, metadata_server=True, **targets)
    assert first != plan(43, 120, metadata_server=True, **targets)


@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_keeps_faults_apart_and_bounded(seed: int) -> None:
    schedule = plan(
        seed, 600, bookies=["bookie-0", "bookie-1"], brokers=["broker-0"], metadata_server=True
    )
    assert len(schedule) > 600 / GAP[1] - 2
    for p, q in itertools.pairwise(schedule):
        assert GAP[0] <= round(q.at - p.at, 2) + 0.01 and q.at - p.at <= GAP[1] + 0.01
        assert p.at + p.duration <= q.at  # healed before the next one starts
    for p in schedule:
        lo, hi = METADATA_HOLD if p.target == "metadata" else HOLD
        assert lo <= p.duration <= hi
        assert p.kind in (("kill", "pause") if p.target == "metadata" else ("kill", "pause", "cut"))
    assert schedule[-1].at + schedule[-1].duration < 600
    assert {p.kind for p in schedule} == {"kill", "pause", "cut"}
    assert {p.target.split("-")[0] for p in schedule} == {"bookie", "broker", "metadata"}


def test_without_a_metadata_server_it_is_never_a_target() -> None:
    schedule = plan(5, 600, bookies=["bookie-0"], brokers=["broker-0"], metadata_server=False)
    assert all(p.target != "metadata" for p in schedule)


class _FakeTopology:
    """Just enough of a Topology for the Nemesis: nodes that run or not, and a log."""

    def __init__(self) -> None:
        self.server = None
        self.nodes = {"bookie-0": None, "broker-0": None}
        self.up = dict.fromkeys(self.nodes, True)
        self.calls: list[tuple[str, str]] = []

    def running(self, name: str) -> bool:
        return self.up[name]

    def start_node(self, name: str) -> None:
        self.calls.append(("start", name))
        self.up[name] = True

    def kill(self, name: str) -> None:
        self.calls.append(("kill", name))
        self.up[name] = False

    def exit_code(self, name: str) -> int:
        return 1

    def log_tail(self, name: str, lines: int = 20) -> str:
        return "boom"

    def heal_all(self) -> None:
        self.calls.append(("heal_all", ""))

    def __getattr__(self, verb: str):  # pause, resume, cut, heal
        return lambda name: self.calls.append((verb, name))


def test_the_nemesis_carries_out_its_schedule_and_supervises_between_faults() -> None:
    from ._nemesis import Nemesis, Planned

    topo = _FakeTopology()
    h = History()
    schedule = [Planned(0.0, "kill", "bookie-0", 0.3), Planned(0.4, "cut", "broker-0", 0.3)]
    nemesis = Nemesis(topo, h, schedule)  # type: ignore[arg-type]
    original_kill = topo.kill

    def kill_and_crash(name: str) -> None:
        original_kill(name)
        topo.up["broker-0"] = False  # another node dies while the fault holds

    topo.kill = kill_and_crash  # type: ignore[method-assign]
    nemesis.start()
    deadline = time.monotonic() + 10
    while (len(h.faults) < 2 or h.faults[-1].healed is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    nemesis.finish(timeout=10)
    verbs = [c for c in topo.calls if c[0] != "heal_all"]
    # the crashed broker is not restarted while the kill holds, only after its heal
    assert verbs[:3] == [("kill", "bookie-0"), ("start", "bookie-0"), ("start", "broker-0")]
    assert ("cut", "broker-0") in verbs and ("heal", "broker-0") in verbs
    assert [e.kind for e in h.events] == ["crash"]  # recorded once
    assert [(f.kind, f.target) for f in h.faults] == [("kill", "bookie-0"), ("cut", "broker-0")]
    assert all(f.healed is not None and f.started is not None for f in h.faults)


def test_a_message_delivered_again_after_its_ack_receipt_fails() -> None:
    h = healthy()
    sub = "a/shared"
    for i in range(3):
        h.receipts.append(AckReceipt(i * 0.1 + 0.05, sub, ("a", "p0", i)))
    h.events.append(Event(1.0, "ack-not-persisted", "a/shared/0: AckNotPersisted: ..."))
    assert check(h).ok
    # a copy that arrived before the receipt is allowed; one after it is not
    h.deliveries.append(Delivery(0.12, sub, f"{sub}/1", ("a", "p0", 2), pos(2), 1))
    h.deliveries.append(Delivery(7.0, sub, f"{sub}/1", ("a", "p0", 1), pos(1), 1))
    r = check(h)
    assert (r.ack_receipts, r.redelivered_after_receipt, r.acks_not_persisted) == (3, 1, 1)
    assert any(v.startswith("(g) 1 messages delivered again") for v in r.violations)
