"""``pigeon standalone``'s broker reaches its own bookie in-process (no loopback TCP), with
either ledger storage; clients still connect over TCP."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio
from standalone_support import produce

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, run_standalone
from pigeon.client.trio import Client
from pigeon.core.testing import receive_n

TIMEOUT = 30


@pytest.mark.parametrize("storage", ["segment-files", "journal"])
async def test_the_standalone_stores_through_its_in_process_bookie(
    tmp_path: Path, storage: str
) -> None:
    broker_config = BrokerConfig(port=0, http_port=-1)
    bookie_config = BookieConfig(port=0, fsync="always", ledger_storage=storage)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            service = await nursery.start(
                functools.partial(run_standalone, tmp_path / "data", broker_config, bookie_config)
            )
            async with Client(service.service_url) as client:
                topic = "persistent://public/default/linked"
                consumer = await client.subscribe(topic, "s", initial_position="earliest")
                sent = [b"m%d" % i for i in range(20)]
                await produce(client, topic, sent)
                got = await receive_n(consumer, len(sent))
                assert [m.value for m in got] == sent
            metrics = "".join(render() for render in service.extra_metrics)
            assert 'link="in_process"} 1' in metrics
            assert 'link="tcp"} 0' in metrics
            nursery.cancel_scope.cancel()
