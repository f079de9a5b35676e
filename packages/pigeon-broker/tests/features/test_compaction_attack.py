"""Hostile review of compaction (issue 17): redelivery of compacted messages whose log
entries are trimmed, ownership moving mid-compaction, deletion racing a compaction."""

from __future__ import annotations

from standalone_support import drain
from test_compaction import HISTORY, compact, kv, send_kv


async def test_compacted_messages_redelivered_after_the_log_was_trimmed(
    small_segments, autojump_clock
):
    from pigeon.client.trio import Client

    async with Client(small_segments.url) as client:
        await send_kv(client, "cattack-redeliver", HISTORY)
        t = await compact(small_segments, "cattack-redeliver")
        await send_kv(client, "cattack-redeliver", [("e", b"e1")])
        policies = small_segments.service.policies.cached(t.name.namespace_name)
        await t.maintain(policies)
        assert t.ledger.first_offset >= len(HISTORY)
        consumer = await client.subscribe(
            "cattack-redeliver", "s", initial_position="earliest", read_compacted=True
        )
        first = await drain(consumer)
        assert kv(first) == [("c", b"c1"), ("a", b"a3"), ("d", b"d1"), ("e", b"e1")]
        await consumer.close()  # nothing acknowledged: all of it comes again
        again = await client.subscribe("cattack-redeliver", "s", read_compacted=True)
        assert kv(await drain(again)) == kv(first)
        await again.close()


async def test_a_redelivered_compacted_message_superseded_since_is_dropped(
    small_segments, autojump_clock
):
    from pigeon.client.trio import Client

    async with Client(small_segments.url) as client:
        await send_kv(client, "cattack-superseded", HISTORY)
        t = await compact(small_segments, "cattack-superseded")
        policies = small_segments.service.policies.cached(t.name.namespace_name)
        await send_kv(client, "cattack-superseded", [("e", b"e1")])
        await t.maintain(policies)
        consumer = await client.subscribe(
            "cattack-superseded", "s", initial_position="earliest", read_compacted=True
        )
        assert kv(await drain(consumer)) == [("c", b"c1"), ("a", b"a3"), ("d", b"d1"), ("e", b"e1")]
        await consumer.close()
        await send_kv(client, "cattack-superseded", [("c", b"c2")])
        await compact(small_segments, "cattack-superseded")
        again = await client.subscribe("cattack-superseded", "s", read_compacted=True)
        got = kv(await drain(again))
        assert sorted(got) == [("a", b"a3"), ("c", b"c2"), ("d", b"d1"), ("e", b"e1")]
        await again.close()
