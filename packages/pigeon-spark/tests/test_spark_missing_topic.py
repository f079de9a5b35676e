"""A streaming read of a topic that does not exist fails with TopicNotFound, as a batch
read does, and does not create it; ``allowAutoTopicCreation=true`` reads it (created).

The stream reader's planning runs against a standalone on loopback (a trio run on a
background thread), without starting Spark: it is the driver-side code Spark calls.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

pytest.importorskip("pyspark")

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, BrokerService, run_standalone
from pigeon.core.errors import TopicNotFound
from pigeon.core.testing.fuzz import ServerThread
from pigeon.spark._clients import client_for, close_clients
from pigeon.spark._options import parse_source_options
from pigeon.spark._source import PigeonBatchReader, PigeonStreamReader


class _Standalone(ServerThread):
    def __init__(self, data_dir: Path) -> None:
        super().__init__("spark-standalone")
        self.data_dir = data_dir
        self.service: BrokerService | None = None

    async def serve(self, nursery: trio.Nursery) -> None:
        broker = BrokerConfig(port=0, http_port=-1)
        bookie = BookieConfig(port=0, fsync="never")
        self.service = await nursery.start(
            functools.partial(run_standalone, self.data_dir, broker, bookie)
        )


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = _Standalone(tmp_path_factory.mktemp("spark-missing") / "data").start()
    try:
        assert server.service is not None
        yield server.service.service_url
    finally:
        close_clients()
        server.stop()


def _topics(url: str) -> list[str]:
    return client_for(url).list_topics("public/default")


def test_a_stream_of_a_missing_topic_fails_and_does_not_create_it(service_url: str) -> None:
    full = "persistent://public/default/stream-missing"
    opts = parse_source_options(
        {"service_url": service_url, "topic": "stream-missing"}, mode="stream"
    )
    with pytest.raises(TopicNotFound) as info:
        PigeonStreamReader(opts).initialOffset()
    text = str(info.value)
    assert full in text and "allowAutoTopicCreation=true" in text and "\n" not in text
    assert full not in _topics(service_url)
    # the batch read says the same (the shared check)
    batch = parse_source_options(
        {"service_url": service_url, "topic": "stream-missing"}, mode="batch"
    )
    with pytest.raises(TopicNotFound, match="allowAutoTopicCreation=true"):
        PigeonBatchReader(batch).partitions()
    assert full not in _topics(service_url)


def test_allow_auto_topic_creation_streams_a_missing_topic(service_url: str) -> None:
    full = "persistent://public/default/stream-created"
    opts = parse_source_options(
        {"service_url": service_url, "topic": "stream-created", "allowAutoTopicCreation": "true"},
        mode="stream",
    )
    assert PigeonStreamReader(opts).initialOffset() == {full: 0}
    assert full in _topics(service_url)
