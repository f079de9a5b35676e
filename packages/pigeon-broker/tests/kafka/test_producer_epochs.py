"""Idempotent producers' epochs: remembered per producer id, and recovered from a
partition's de-duplication state (rebuilt from the log) on a broker that took it over."""

from __future__ import annotations

from pigeon.broker import _kafka_produce
from pigeon.broker._dedup import Deduplication
from pigeon.broker._kafka_produce import ProducerEpochs


def test_an_epoch_stored_before_a_failover_is_still_the_highest() -> None:
    dedup = Deduplication()  # what the new owner rebuilt from the log
    dedup.persisted("kafka-42-3", 0, 2, (1, 0, 0))
    dedup.persisted("kafka-4-9", 0, 2, (1, 1, 2))  # another id sharing the digits
    dedup.persisted("native-producer", 0, 1, (1, 2, 4))
    epochs = ProducerEpochs()
    assert epochs.highest(42, dedup) == 3
    assert epochs.highest(7, dedup) == -1


def test_epochs_only_rise_and_old_ids_are_forgotten(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_kafka_produce, "MAX_PRODUCERS", 2)
    epochs = ProducerEpochs()
    epochs.saw(1, 5)
    epochs.saw(1, 2)
    assert epochs.highest(1) == 5
    epochs.saw(2, 0)
    epochs.saw(3, 0)  # id 1 is the least recent: forgotten
    assert epochs.highest(1) == -1
