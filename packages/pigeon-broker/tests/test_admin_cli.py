"""``pigeon admin`` against a running standalone: every admin endpoint through the CLI.

The server (broker + bookie + embedded metadata + admin HTTP) runs on a background thread
(see ``test_admin_support``); messages are produced and consumed with the real client.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from admin_support import AdminStandalone
from click.testing import CliRunner, Result

from pigeon.client import Client, MessageId
from pigeon.client._admin_cli import admin_cmd, parse_time
from pigeon.core import TopicName
from pigeon.core.testing.servers import free_port

NS = "public/default"


def admin(server: AdminStandalone, *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(admin_cmd, ["--url", server.url, *args])
    assert result.exit_code == code, (
        f"pigeon admin {' '.join(args)} -> {result.exit_code}\nstdout: {result.stdout}\n"
        f"stderr: {result.stderr}\nexception: {result.exception!r}"
    )
    return result


def admin_json(server: AdminStandalone, *args: str) -> Any:
    return json.loads(admin(server, "--json", *args).stdout)


def admin_error(server: AdminStandalone, *args: str, status: int) -> dict[str, Any]:
    """Run a command that the API refuses: exit code 1, the JSON error on stderr (with
    --json; without it, one ``error: ...`` line)."""
    text = admin(server, *args, code=1).stderr
    assert text.startswith("error: ") and text.count("\n") == 1, text
    assert f"(HTTP {status})" in text, text
    result = admin(server, "--json", *args, code=1)
    error = json.loads(result.stderr.strip().splitlines()[-1])
    assert error["status"] == status, error
    assert error["message"]
    return error


def produce(
    server: AdminStandalone, topic: str, n: int, *, prefix: str = "m", key: str | None = None
) -> list[MessageId]:
    """n messages, one entry each (each send waits for its receipt)."""
    with Client(server.service_url) as client, client.create_producer(topic) as producer:
        return [
            producer.send(f"{prefix}{i}".encode(), key=key, properties={"i": str(i)})
            for i in range(n)
        ]


def ledger_node(server: AdminStandalone, topic: str) -> Any:
    assert server.service is not None
    path = f"/pigeon/ledgers/{TopicName.parse(topic).path}"
    return server.call(server.service.store.get, path)


# ---------------------------------------------------------------------- cluster


def test_health_brokers_bookies(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    out = admin(s, "health").stdout
    assert "status   ok" in out and "bookies" in out
    health = admin_json(s, "health")
    assert health["status"] == "ok"
    assert health["checks"]["bookies"]["writable"] == 1
    assert health["checks"]["metadata"]["ok"] is True

    brokers = admin_json(s, "brokers", "list")
    assert [b["service_url"] for b in brokers] == [s.service_url]
    assert brokers[0]["http_url"] == s.url
    broker = brokers[0]["broker"]
    assert broker in admin(s, "brokers", "list").stdout
    load = admin_json(s, "brokers", "load")  # the broker answering
    assert load["broker"] == broker and load["connections"] >= 0
    assert admin(s, "brokers", "load", broker).stdout.startswith("broker")
    admin_error(s, "brokers", "load", "10.255.255.1:1", status=404)
    produce(s, "adm-owned", 1)  # this broker now owns the topic's bundle
    owned = admin_json(s, "brokers", "bundles", broker)
    assert owned and all(b["owner"] == broker for b in owned)
    assert any(b["loaded_topics"] >= 1 and b["namespace"] == NS for b in owned)
    assert "LOADED TOPICS" in admin(s, "brokers", "bundles").stdout
    admin_error(s, "brokers", "bundles", "nope:1", status=404)
    assert isinstance(admin_json(s, "brokers", "throughput"), list)
    assert "RATE IN" in admin(s, "brokers", "throughput").stdout

    bookies = admin_json(s, "bookies", "list")
    assert len(bookies) == 1 and bookies[0]["read_only"] is False
    address = bookies[0]["address"]
    assert address in admin(s, "bookies", "list").stdout
    one = admin_json(s, "bookies", "get", address)
    assert one["free_disk_bytes"] > 0 and one["total_disk_bytes"] >= one["free_disk_bytes"]
    admin_error(s, "bookies", "get", "127.0.0.1:1", status=404)


def test_json_flag_works_after_the_subcommand_too(admin_standalone: AdminStandalone) -> None:
    assert json.loads(admin(admin_standalone, "tenants", "list", "--json").stdout) == json.loads(
        admin(admin_standalone, "--json", "tenants", "list").stdout
    )


def test_unreachable_broker_exits_1_with_one_error_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(admin_cmd, ["--url", url, "tenants", "list"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: ConnectionError: cannot reach {url}")
    assert result.stderr.count("\n") == 1
    result = CliRunner().invoke(admin_cmd, ["--url", url, "--json", "tenants", "list"])
    error = json.loads(result.stderr)
    assert error["error"] == "ConnectionError" and error["status"] == 0


def test_url_from_environment(admin_standalone: AdminStandalone) -> None:
    result = CliRunner().invoke(
        admin_cmd, ["tenants", "list"], env={"PIGEON_ADMIN_URL": admin_standalone.url}
    )
    assert result.exit_code == 0 and "public" in result.stdout.split()


# ---------------------------------------------------------------------- tenants, namespaces


def test_tenants_lifecycle(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    assert (
        "tenant acme created" in admin(s, "tenants", "create", "acme", "--admin-role", "ops").stdout
    )
    err = admin_error(s, "tenants", "create", "acme", status=409)
    assert err["error"] == "NodeExists"
    assert {"acme", "public"} <= set(admin(s, "tenants", "list").stdout.split())
    assert admin_json(s, "tenants", "get", "acme")["admin_roles"] == ["ops"]
    admin(s, "namespaces", "create", "acme/ns1")
    assert admin_json(s, "namespaces", "list", "acme") == ["acme/ns1"]
    assert admin_error(s, "tenants", "delete", "acme", status=409)["error"] == "NotEmpty"
    admin(s, "namespaces", "delete", "acme/ns1")
    admin(s, "tenants", "delete", "acme")
    admin_error(s, "tenants", "get", "acme", status=404)
    admin_error(s, "tenants", "delete", "acme", status=404)
    admin_error(s, "namespaces", "list", "acme", status=404)
    admin_error(s, "namespaces", "create", "acme/ns2", status=404)  # no such tenant
    admin_error(s, "tenants", "create", "bad name", status=422)


def test_namespace_policies_change_what_the_broker_enforces(
    admin_standalone: AdminStandalone,
) -> None:
    s = admin_standalone
    assert s.service is not None
    admin(s, "namespaces", "create", "public/pol", "-p", "message_ttl_s=60")
    assert admin_json(s, "namespaces", "policies", "public/pol")["message_ttl_s"] == 60
    admin_error(s, "namespaces", "create", "public/pol", status=409)
    assert "public/pol" in admin_json(s, "namespaces", "list", "public")

    out = admin(
        s,
        "namespaces",
        "set-policies",
        "public/pol",
        "retention_time_s=-1",
        "backlog_quota_policy=producer_exception",
        "deduplication=false",
    ).stdout
    assert "producer_exception" in out
    cached = s.call_sync(s.service.policies.cached, "public/pol")
    assert (cached.retention_time_s, cached.backlog_quota_policy, cached.deduplication) == (
        -1,
        "producer_exception",
        False,
    )
    assert cached.message_ttl_s == 60  # untouched
    # durations and sizes read as a person writes them (the JSON keeps the numbers)
    out = admin(
        s,
        "namespaces",
        "set-policies",
        "public/pol",
        "message_ttl_s=86400",
        "backlog_quota_bytes=16920763",
    ).stdout
    lines = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()}
    assert (lines["message_ttl_s"], lines["backlog_quota_bytes"]) == ("1 d", "16.9 MB")
    assert lines["offload_deletion_lag_s"] == "4 h"
    admin(s, "namespaces", "set-policies", "public/pol", "message_ttl_s=60")
    # replication: null means "the broker's default"
    admin(
        s,
        "namespaces",
        "set-policies",
        "public/pol",
        "ensemble_size=1",
        "write_quorum=1",
        "ack_quorum=1",
    )
    pol = admin_json(
        s,
        "namespaces",
        "set-policies",
        "public/pol",
        "ensemble_size=null",
        "write_quorum=null",
        "ack_quorum=null",
    )
    assert pol["ensemble_size"] is None

    admin_error(
        s, "namespaces", "set-policies", "public/pol", "backlog_quota_policy=bogus", status=422
    )
    admin_error(s, "namespaces", "set-policies", "public/pol", "no_such_policy=1", status=422)
    admin_error(s, "namespaces", "set-policies", "public/pol", "message_ttl_s=-5", status=422)
    err = admin_error(s, "namespaces", "set-policies", "public/pol", "ensemble_size=2", status=400)
    assert err["error"] == "InvalidArgument"
    admin_error(s, "namespaces", "set-policies", "public/nope", "message_ttl_s=1", status=404)
    admin_error(s, "namespaces", "policies", "public/nope", status=404)
    admin(s, "namespaces", "set-policies", "public/pol", "garbage", code=2)
    admin(s, "namespaces", "policies", "not-a-namespace", code=2)

    assert admin_json(s, "namespaces", "topics", "public/pol") == []
    bundles = admin_json(s, "namespaces", "bundles", "public/pol")
    ranges = [b["bundle"] for b in bundles]
    assert ranges[0].startswith("0x00000000_") and ranges[-1].endswith("_0x100000000")
    assert all(a.split("_")[1] == b.split("_")[0] for a, b in itertools.pairwise(ranges))
    assert all(b["owner"] is None and b["loaded_topics"] == 0 for b in bundles)  # no topic yet
    assert ranges[0] in admin(s, "namespaces", "bundles", "public/pol").stdout

    produce(s, "persistent://public/pol/t1", 2)
    assert admin_json(s, "namespaces", "topics", "public/pol") == ["persistent://public/pol/t1"]
    assert admin_error(s, "namespaces", "delete", "public/pol", status=409)["error"] == "NotEmpty"
    admin(s, "namespaces", "delete", "public/pol", "--force")
    assert ledger_node(s, "persistent://public/pol/t1") is None
    assert "persistent://public/pol/t1" not in s.service.topics
    admin_error(s, "namespaces", "delete", "public/pol", status=404)


# ---------------------------------------------------------------------- topics


def test_topics_lifecycle(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    assert s.service is not None
    created = admin_json(s, "topics", "create", "adm-t1")
    assert created == {
        "topic": "persistent://public/default/adm-t1",
        "persistent": True,
        "partitions": 0,
        "loaded": 1,
    }
    admin_error(s, "topics", "create", "adm-t1", status=409)
    assert "with 3 partitions" in admin(s, "topics", "create", "adm-p", "-p", "3").stdout
    assert admin_json(s, "topics", "get", "adm-p")["partitions"] == 3
    admin_error(s, "topics", "create", "adm-p-partition-1", status=409)
    listed = admin_json(s, "topics", "list")
    assert "persistent://public/default/adm-t1" in listed
    assert "persistent://public/default/adm-p" in listed
    assert not any("adm-p-partition" in t for t in listed)
    admin_error(s, "topics", "get", "adm-missing", status=404)
    admin_error(s, "topics", "stats", "adm-missing", status=404)
    admin_error(s, "topics", "create", "persistent://public/nope/t", status=404)
    admin(s, "topics", "create", "a/b", code=2)  # not a topic name: usage error
    admin(s, "topics", "create", "adm-t2", "--partitions", "-1", code=2)

    produce(s, "adm-t1", 5)
    stats = admin_json(s, "topics", "stats", "adm-t1")
    assert (stats["msgs_in"], stats["next_offset"], stats["producers"]) == (5, 5, 0)
    assert stats["storage_size"] > 0 and stats["segments"] >= 1
    text = admin(s, "topics", "stats", "adm-t1").stdout
    assert "messages in    5" in text and "storage" in text

    internal = admin_json(s, "topics", "internal-stats", "adm-t1")
    assert sum(seg["entries"] for seg in internal["segments"]) == 5
    assert internal["segments"][0]["ensemble"]
    assert "FIRST OFFSET" in admin(s, "topics", "internal-stats", "adm-t1").stdout
    admin_error(s, "topics", "internal-stats", "adm-p", status=400)

    pstats = admin_json(s, "topics", "stats", "adm-p")
    assert pstats["partitions"] == 3 and len(pstats["partition_stats"]) == 3

    loaded = admin_json(s, "topics", "loaded")
    row = next(t for t in loaded if t["topic"] == "persistent://public/default/adm-t1")
    assert row["msgs_in"] == 5
    assert "adm-t1" in admin(s, "topics", "loaded").stdout

    # non-persistent topics exist in memory only
    admin(s, "topics", "create", "non-persistent://public/default/adm-np")
    np_stats = admin_json(s, "topics", "stats", "non-persistent://public/default/adm-np")
    assert np_stats["persistent"] is False and np_stats["storage_size"] == 0
    admin_error(
        s, "subscriptions", "create", "non-persistent://public/default/adm-np", "s", status=400
    )
    admin(s, "topics", "delete", "non-persistent://public/default/adm-np")
    admin_error(s, "topics", "get", "non-persistent://public/default/adm-np", status=404)

    # delete: refused while a producer is attached, unless forced; the data goes
    segments = [seg["id"] for seg in internal["segments"]]
    with Client(s.service_url) as client, client.create_producer("adm-t1") as producer:
        producer.send(b"x")
        err = admin_error(s, "topics", "delete", "adm-t1", status=409)
        assert "force" in err["message"]
        admin(s, "topics", "delete", "adm-t1", "--force")
    if ledger_node(s, "adm-t1") is not None:  # the detached producer re-attached: a new topic
        assert admin_json(s, "topics", "stats", "adm-t1")["msgs_in"] == 0
    for seg_id in segments:
        assert s.call(s.service.store.get, f"/pigeon/segments/{seg_id:016x}") is None

    admin(s, "topics", "delete", "adm-p")
    admin_error(s, "topics", "get", "adm-p", status=404)
    assert (
        s.call(s.service.store.get, "/pigeon/partitioned-topics/persistent/public/default/adm-p")
        is None
    )
    admin_error(s, "topics", "delete", "adm-p", status=404)


def test_deleted_topic_leaves_no_data_behind(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    assert s.service is not None
    produce(s, "adm-del", 3)
    admin(s, "subscriptions", "create", "adm-del", "sub", "--position", "earliest")
    internal = admin_json(s, "topics", "internal-stats", "adm-del")
    admin(s, "topics", "delete", "adm-del")
    path = TopicName.parse("adm-del").path
    store = s.service.store
    assert s.call(store.get, f"/pigeon/ledgers/{path}") is None
    assert s.call(store.children, f"/pigeon/cursors/{path}") == []
    assert s.call(store.get, f"/pigeon/dedup/{path}") is None
    for seg in internal["segments"]:
        assert s.call(store.get, f"/pigeon/segments/{seg['id']:016x}") is None
    admin_error(s, "topics", "get", "adm-del", status=404)
    # a new topic of the same name starts empty
    produce(s, "adm-del", 1)
    assert admin_json(s, "topics", "stats", "adm-del")["next_offset"] == 1


# ---------------------------------------------------------------------- subscriptions


@pytest.fixture
def ten_messages(admin_standalone: AdminStandalone) -> Iterator[tuple[str, list[MessageId]]]:
    topic = f"adm-subs-{time.monotonic_ns()}"
    ids = produce(admin_standalone, topic, 10, key="k")
    yield topic, ids
    admin(admin_standalone, "topics", "delete", topic, "--force")


def _mid(m: MessageId, index: int | None = None) -> str:
    return f"{m.segment_id}:{m.entry_id}" + (f":{index}" if index is not None else "")


def test_subscriptions_create_at_positions(
    admin_standalone: AdminStandalone, ten_messages: tuple[str, list[MessageId]]
) -> None:
    s = admin_standalone
    topic, ids = ten_messages
    assert (
        "backlog 10"
        in admin(s, "subscriptions", "create", topic, "s-first", "--position", "earliest").stdout
    )
    assert admin_json(s, "subscriptions", "create", topic, "s-last")["backlog"] == 0
    assert (
        admin_json(s, "subscriptions", "create", topic, "s-off", "--position", "4")["backlog"] == 6
    )
    made = admin_json(s, "subscriptions", "create", topic, "s-id", "--position", _mid(ids[7]))
    assert made["backlog"] == 3 and made["mark_delete_offset"] == 7
    admin_error(s, "subscriptions", "create", topic, "s-first", status=409)
    admin_error(s, "subscriptions", "create", topic, "s-bad", "--position", "sideways", status=422)
    admin_error(s, "subscriptions", "create", topic, "s-bad", "--position", "999:0", status=404)
    admin_error(s, "subscriptions", "create", topic, "s-bad", "--position", "-3", status=422)
    admin_error(s, "subscriptions", "create", "adm-nowhere", "s", status=404)
    assert admin_json(s, "subscriptions", "list", topic) == ["s-first", "s-id", "s-last", "s-off"]
    assert admin_json(s, "subscriptions", "get", topic, "s-off")["backlog"] == 6
    assert "backlog" in admin(s, "subscriptions", "get", topic, "s-off").stdout
    admin_error(s, "subscriptions", "get", topic, "s-none", status=404)
    stats = admin_json(s, "topics", "stats", topic)
    assert {k: v["backlog"] for k, v in stats["subscriptions"].items()} == {
        "s-first": 10,
        "s-id": 3,
        "s-last": 0,
        "s-off": 6,
    }
    assert stats["backlog"] == 10


def test_peek_skip_and_reset(
    admin_standalone: AdminStandalone, ten_messages: tuple[str, list[MessageId]]
) -> None:
    s = admin_standalone
    topic, ids = ten_messages
    admin(s, "subscriptions", "create", topic, "sub", "--position", "earliest")

    peeked = admin_json(s, "subscriptions", "peek", topic, "sub", "-n", "3")
    assert [m["value"] for m in peeked] == ["m0", "m1", "m2"]
    assert peeked[1]["message_id"] == _mid(ids[1], 0)
    assert (peeked[1]["key"], peeked[1]["properties"], peeked[1]["offset"]) == ("k", {"i": "1"}, 1)
    text = admin(s, "subscriptions", "peek", topic, "sub", "-n", "2").stdout
    assert "m0" in text and "key=k" in text
    # peeking does not consume
    assert admin_json(s, "subscriptions", "get", topic, "sub")["backlog"] == 10

    assert "skipped 4 messages" in admin(s, "subscriptions", "skip", topic, "sub", "4").stdout
    assert admin_json(s, "subscriptions", "get", topic, "sub")["backlog"] == 6
    assert admin_json(s, "subscriptions", "peek", topic, "sub")[0]["value"] == "m4"
    assert admin_json(s, "subscriptions", "skip", topic, "sub", "100")["skipped"] == 6
    admin(s, "subscriptions", "skip", topic, "sub", code=2)  # neither COUNT nor --all

    out = admin_json(s, "subscriptions", "reset", topic, "sub", "--offset", "2")
    assert [(r["mark_delete_offset"], r["backlog"]) for r in out] == [(2, 8)]
    out = admin_json(s, "subscriptions", "reset", topic, "sub", "--message-id", _mid(ids[5]))
    assert out[0]["backlog"] == 5
    assert (
        "MARK DELETE OFFSET"
        in admin(s, "subscriptions", "reset", topic, "sub", "--time", "1h").stdout
    )
    assert admin_json(s, "subscriptions", "get", topic, "sub")["backlog"] == 10
    out = admin_json(
        s, "subscriptions", "reset", topic, "sub", "--time", "2099-01-01T00:00:00+00:00"
    )
    assert out[0]["backlog"] == 0
    assert admin_json(s, "subscriptions", "peek", topic, "sub") == []
    assert "no unacknowledged" in admin(s, "subscriptions", "peek", topic, "sub").stdout
    assert "skipped 0" in admin(s, "subscriptions", "skip", topic, "sub", "--all").stdout
    admin(s, "subscriptions", "reset", topic, "sub", code=2)
    admin(s, "subscriptions", "reset", topic, "sub", "--offset", "1", "--time", "1m", code=2)
    admin(s, "subscriptions", "reset", topic, "sub", "--time", "yesterday-ish", code=2)
    admin_error(s, "subscriptions", "reset", topic, "sub", "--message-id", "999:1", status=404)
    admin_error(s, "subscriptions", "reset", topic, "sub", "--message-id", "x", status=422)
    admin_error(s, "subscriptions", "reset", topic, "nope", "--offset", "1", status=404)
    admin_error(s, "subscriptions", "peek", topic, "nope", status=404)
    admin_error(s, "subscriptions", "skip", topic, "nope", "1", status=404)


def test_skip_counts_only_unacknowledged_messages(
    admin_standalone: AdminStandalone, ten_messages: tuple[str, list[MessageId]]
) -> None:
    s = admin_standalone
    topic, _ids = ten_messages
    with s.consumer(topic, "gaps", subscription_type="shared") as consumer:
        got = {m.value: m for m in (consumer.receive(timeout=10) for _ in range(10))}
        for v in (b"m1", b"m2", b"m5"):  # individually acknowledged
            consumer.acknowledge(got[v])
        deadline = time.monotonic() + 10
        while admin_json(s, "subscriptions", "get", topic, "gaps")["backlog"] != 7:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # unacknowledged: m0 m3 m4 m6 ...; skipping 3 acknowledges m0 m3 m4
    assert admin_json(s, "subscriptions", "skip", topic, "gaps", "3")["skipped"] == 3
    sub = admin_json(s, "subscriptions", "get", topic, "gaps")
    assert (sub["backlog"], sub["mark_delete_offset"]) == (4, 6)


def test_reset_redelivers_to_a_connected_consumer(
    admin_standalone: AdminStandalone, ten_messages: tuple[str, list[MessageId]]
) -> None:
    s = admin_standalone
    topic, _ids = ten_messages
    with s.consumer(topic, "live") as consumer:
        for i in range(10):
            msg = consumer.receive(timeout=10)
            assert msg.value == f"m{i}".encode()
            consumer.acknowledge(msg)
        admin(s, "subscriptions", "reset", topic, "live", "--offset", "7")
        assert [consumer.receive(timeout=10).value for _ in range(3)] == [b"m7", b"m8", b"m9"]


def test_delete_subscription(
    admin_standalone: AdminStandalone, ten_messages: tuple[str, list[MessageId]]
) -> None:
    s = admin_standalone
    assert s.service is not None
    topic, _ids = ten_messages
    admin(s, "subscriptions", "create", topic, "idle")
    admin(s, "subscriptions", "delete", topic, "idle")
    admin(s, "subscriptions", "create", topic, "busy", "--position", "earliest")
    with Client(s.service_url) as client, client.subscribe(topic, "busy") as _consumer:
        deadline = time.monotonic() + 10
        while admin_json(s, "subscriptions", "get", topic, "busy")["consumers"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert admin_error(s, "subscriptions", "delete", topic, "busy", status=409)["error"] == (
            "SubscriptionBusy"
        )
        admin(s, "subscriptions", "delete", topic, "busy", "--force")
        # The detached consumer re-attaches (as Pulsar's do) and so subscribes anew at its
        # initial position (latest): the old cursor, 10 messages behind, is gone.
        deadline = time.monotonic() + 10
        while True:
            subs = admin_json(s, "topics", "stats", topic)["subscriptions"]
            if "busy" in subs and subs["busy"]["consumers"] == 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert subs["busy"]["mark_delete_offset"] == 10
    path = f"/pigeon/cursors/{TopicName.parse(topic).path}"
    # the closing consumer may re-attach and re-create it; what the API deleted stays gone
    assert "idle" not in s.call(s.service.store.children, path)
    admin_error(s, "subscriptions", "delete", topic, "idle", status=404)


def test_partitioned_topic_subscriptions(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "topics", "create", "adm-part", "--partitions", "2")
    with Client(s.service_url) as client, client.create_producer("adm-part") as producer:
        for i in range(6):
            producer.send(f"p{i}".encode())
    admin(s, "subscriptions", "create", "adm-part", "ps", "--position", "earliest")
    admin_error(s, "subscriptions", "create", "adm-part", "px", "--position", "3", status=400)
    assert admin_json(s, "subscriptions", "list", "adm-part") == ["ps"]
    sub = admin_json(s, "subscriptions", "get", "adm-part", "ps")
    assert sub["backlog"] == 6
    assert len(admin_json(s, "subscriptions", "peek", "adm-part", "ps", "-n", "6")) == 6
    assert admin_json(s, "subscriptions", "skip", "adm-part", "ps", "1")["skipped"] == 2
    admin_error(s, "subscriptions", "reset", "adm-part", "ps", "--offset", "0", status=400)
    out = admin_json(s, "subscriptions", "reset", "adm-part", "ps", "--time", "1h")
    assert sorted(r["topic"][-11:] for r in out) == ["partition-0", "partition-1"]
    assert sum(r["backlog"] for r in out) == 6
    one = "persistent://public/default/adm-part-partition-0"
    assert (
        admin_json(s, "subscriptions", "reset", one, "ps", "--offset", "1")[0]["mark_delete_offset"]
        == 1
    )
    admin_error(s, "topics", "delete", one, status=400)
    admin(s, "subscriptions", "delete", "adm-part", "ps")
    assert admin_json(s, "subscriptions", "list", "adm-part") == []
    admin(s, "topics", "delete", "adm-part")


# ---------------------------------------------------------------------- unload, metrics


def _receive_until(consumer: Any, value: bytes) -> set[bytes]:
    """Receive (and acknowledge) until ``value``; the other values seen on the way."""
    others: set[bytes] = set()
    while True:
        msg = consumer.receive(timeout=20)
        consumer.acknowledge(msg)
        if msg.value == value:
            return others
        others.add(msg.value)


def test_unload_closes_topics_and_clients_come_back(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    assert s.service is not None
    topic = "persistent://public/default/adm-unload"
    with (
        Client(s.service_url) as client,
        client.create_producer(topic) as producer,
        client.subscribe(topic, "u", initial_position="earliest") as consumer,
    ):
        producer.send(b"before")
        assert consumer.receive(timeout=10).value == b"before"
        unloaded = admin_json(s, "namespaces", "unload", NS)  # every bundle it owns
        assert topic in unloaded["unloaded"]
        producer.send(b"after", timeout=20)  # re-attached to the reloaded topic
        # what was not acknowledged before the unload may come again (at least once)
        assert _receive_until(consumer, b"after") <= {b"before"}
        assert "unloaded 1 topic" in admin(s, "topics", "unload", topic).stdout
        producer.send(b"again", timeout=20)
        assert _receive_until(consumer, b"again") <= {b"before", b"after"}
    assert admin_json(s, "topics", "stats", topic)["next_offset"] == 3
    bundle = s.service.ownership.bundle_of(TopicName.parse(topic))
    assert topic in admin_json(s, "namespaces", "unload", NS, "--bundle", bundle)["unloaded"]
    owners = {b["bundle"]: b["owner"] for b in admin_json(s, "namespaces", "bundles", NS)}
    assert owners[bundle] is None  # given up; the next lookup assigns it again
    admin_error(s, "namespaces", "unload", NS, "--bundle", "0x0_0x1", status=404)
    admin_error(s, "namespaces", "unload", "public/nope", status=404)
    admin_error(s, "topics", "unload", "adm-does-not-exist", status=404)


def test_metrics_command(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    produce(s, "adm-metrics", 3)
    out = admin(s, "metrics", "--grep", "pigeon_topic_messages_in_total").stdout
    assert (
        'pigeon_topic_messages_in_total{topic="persistent://public/default/adm-metrics"} 3.0' in out
    )
    assert "# HELP" in admin(s, "metrics").stdout


def test_parse_time() -> None:
    now = 1_700_000_000_000
    assert parse_time("1699999999000", now_ms=now) == 1_699_999_999_000
    assert parse_time("10m", now_ms=now) == now - 600_000
    assert parse_time("1.5h", now_ms=now) == now - 5_400_000
    assert parse_time("2023-11-14T22:13:20+00:00", now_ms=now) == now


def test_topics_compact_and_compaction_status(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "topics", "create", "adm-compact")
    started = admin(s, "topics", "compact", "adm-compact").stdout
    assert started.startswith("compaction of adm-compact: "), started
    assert "status" in admin_json(s, "topics", "compact", "adm-compact")
    assert "status" in admin(s, "topics", "compaction-status", "adm-compact").stdout
    assert "status" in admin_json(s, "topics", "compaction-status", "adm-compact")


def test_namespaces_set_compaction_threshold(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    admin(s, "namespaces", "create", "public/cthr")
    out = admin(s, "namespaces", "set-compaction-threshold", "public/cthr", "-t", "10M").stdout
    assert out.strip() == f"compaction threshold of public/cthr is {10 << 20} bytes"
    policies = admin_json(s, "namespaces", "policies", "public/cthr")
    assert policies["compaction_threshold"] == 10 << 20
    admin(s, "namespaces", "set-compaction-threshold", "public/cthr", "-t", "-1", code=2)
