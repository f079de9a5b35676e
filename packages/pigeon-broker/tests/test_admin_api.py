"""The admin HTTP API itself: error statuses and bodies, the OpenAPI document, logging,
the dashboard files and the Prometheus exposition."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from admin_support import AdminStandalone
from prometheus_client.parser import text_string_to_metric_families

from pigeon.broker._admin import http_status
from pigeon.client import Client
from pigeon.core import errors

API = "/admin/v2"
T = f"{API}/topics/persistent/public/default"


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.TopicNotFound(), 404),
        (errors.SubscriptionNotFound(), 404),
        (errors.NoSuchNode(), 404),
        (errors.EntryNotFound(), 404),
        (errors.TopicExists(), 409),
        (errors.NodeExists(), 409),
        (errors.NotEmpty(), 409),
        (errors.SubscriptionBusy(), 409),
        (errors.ProducerBusy(), 409),
        (errors.NotOwner(), 409),
        (errors.InvalidArgument(), 400),
        (errors.InvalidTopicName(), 400),
        (errors.NotSupported(), 400),
        (errors.ServiceUnavailable(), 503),
        (errors.MetadataError(), 503),
        (errors.StorageError(), 503),
        (errors.Timeout(), 504),
        (errors.PigeonError(), 500),
    ],
)
def test_error_classes_map_to_http_statuses(exc: errors.PigeonError, status: int) -> None:
    assert http_status(exc) == status


def test_openapi_document_lists_every_endpoint(admin_standalone: AdminStandalone) -> None:
    status, doc, _ = admin_standalone.http_call("GET", "/openapi.json")
    assert status == 200
    routes = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    t = "/admin/v2/topics/{domain}/{tenant}/{namespace}/{topic}"
    s = t + "/subscriptions/{subscription}"
    ns = "/admin/v2/namespaces/{tenant}/{namespace}"
    sc = "/admin/v2/schemas/{tenant}/{namespace}/{topic}"
    expected = {  # path: its methods
        "/admin/v2/cluster/health": "GET",
        "/admin/v2/tenants": "GET",
        "/admin/v2/tenants/{tenant}": "PUT POST GET DELETE",
        "/admin/v2/namespaces/{tenant}": "GET",
        ns: "PUT DELETE",
        ns + "/policies": "GET PATCH",
        ns + "/topics": "GET",
        ns + "/bundles": "GET",
        ns + "/bundles/{bundle}/unload": "POST",
        ns + "/permissions": "GET",
        ns + "/permissions/{role}": "POST DELETE",
        ns + "/subscriptionAuthMode": "POST",
        t + "/permissions": "GET",
        t + "/permissions/{role}": "POST DELETE",
        t: "PUT GET DELETE",
        t + "/stats": "GET",
        t + "/internal-stats": "GET",
        t + "/unload": "POST",
        t + "/offload": "GET PUT",
        t + "/compaction": "GET PUT",
        t + "/subscriptions": "GET",
        s: "PUT GET DELETE",
        s + "/reset-cursor": "POST",
        s + "/skip": "POST",
        s + "/clear-backlog": "POST",
        s + "/peek": "GET",
        "/admin/v2/brokers": "GET",
        "/admin/v2/brokers/{broker}/load": "GET",
        "/admin/v2/brokers/{broker}/bundles": "GET",
        "/admin/v2/broker-stats/topics": "GET",
        "/admin/v2/broker-stats/throughput": "GET",
        "/admin/v2/bookies": "GET",
        "/admin/v2/bookies/{bookie}": "GET",
        sc + "/schema": "GET POST DELETE",
        sc + "/schema/{version}": "GET",
        sc + "/schemas": "GET",
        sc + "/compatibility": "POST",
        "/metrics": "GET",
    }
    assert routes == {(m, p) for p, ms in expected.items() for m in ms.split()}
    # every admin operation documents its JSON errors
    for path, item in doc["paths"].items():
        if path.startswith(API):
            for op in item.values():
                assert {"404", "409", "422"} <= set(op["responses"]), (path, op["operationId"])


def test_errors_are_json_with_class_and_message(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    status, body, headers = s.http_call("GET", f"{T}/no-such-topic/stats")
    assert status == 404 and headers["content-type"] == "application/json"
    assert body == {
        "error": "TopicNotFound",
        "message": "topic persistent://public/default/no-such-topic does not exist",
        "code": errors.TopicNotFound.code,
        "retriable": False,
    }
    status, body, _ = s.http_call("GET", f"{API}/no/such/route")
    assert status == 404 and body["error"] == "NotFound"
    status, body, _ = s.http_call("POST", f"{API}/tenants")
    assert status == 405 and body["error"] == "MethodNotAllowed"


@pytest.mark.parametrize(
    ("method", "path", "raw"),
    [
        ("PATCH", f"{API}/namespaces/public/default/policies", b"{not json"),
        ("PATCH", f"{API}/namespaces/public/default/policies", b"[1, 2]"),
        ("PATCH", f"{API}/namespaces/public/default/policies", b'{"message_ttl_s": "soon"}'),
        ("PATCH", f"{API}/namespaces/public/default/policies", b'{"message_ttl_s": 1e300}'),
        ("PATCH", f"{API}/namespaces/public/default/policies", b'{"unknown": 1}'),
        ("PUT", f"{API}/tenants/t-bad-body", b'{"admin_roles": "not-a-list"}'),
        ("POST", f"{T}/x/subscriptions/s/reset-cursor", b"{}"),
        ("POST", f"{T}/x/subscriptions/s/reset-cursor", b'{"offset": 1, "timestamp": 2}'),
        ("POST", f"{T}/x/subscriptions/s/reset-cursor", b'{"offset": -1}'),
        ("POST", f"{T}/x/subscriptions/s/skip", b'{"count": "many"}'),
        ("PUT", f"{T}/x?partitions=-1", None),
        ("PUT", f"{T}/x?partitions=99999", None),
        ("GET", f"{API}/topics/durable/public/default/x", None),
        ("GET", f"{API}/topics/persistent/public/default/bad%20name", None),
        ("GET", f"{T}/x/subscriptions/s/peek?count=0", None),
    ],
)
def test_malformed_requests_are_422(
    admin_standalone: AdminStandalone, method: str, path: str, raw: bytes | None
) -> None:
    status, body, _ = admin_standalone.http_call(method, path, raw=raw)
    assert status == 422, body
    assert body["error"] == "ValidationError" and body["detail"]


def test_bad_values_are_400_and_conflicts_409(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    status, body, _ = s.http_call(
        "PATCH", f"{API}/namespaces/public/default/policies", {"ensemble_size": 3}
    )
    assert status == 400 and body["error"] == "InvalidArgument"
    assert s.http_call("PUT", f"{API}/tenants/conflicted")[0] == 201
    status, body, _ = s.http_call("PUT", f"{API}/tenants/conflicted")
    assert status == 409 and body["error"] == "NodeExists"
    assert s.http_call("PUT", f"{API}/namespaces/conflicted/ns")[0] == 201
    status, body, _ = s.http_call("DELETE", f"{API}/tenants/conflicted")
    assert status == 409 and body["error"] == "NotEmpty"
    status, body, _ = s.http_call("PUT", f"{API}/topics/persistent/conflicted/ns/..")
    assert status in (400, 404, 422)  # never a 5xx


def test_names_at_the_length_limit_and_dot_names(admin_standalone: AdminStandalone) -> None:
    """A partitioned topic of a 255-letter name: its partitions (267 letters with their
    suffix) are reachable; '.' and '..' are refused as topic names, not as metadata paths."""
    s = admin_standalone
    base = "p" * 255
    assert s.http_call("PUT", f"{T}/{base}?partitions=2")[0] in (200, 201, 204)
    status, body, _ = s.http_call("GET", f"{T}/{base}-partition-1/stats")
    assert status == 200, body
    for name in (".", ".."):
        status, body, _ = s.http_call("GET", f"{T}/{name}/stats")
        assert status == 400 and body["error"] == "InvalidTopicName", body
        assert "may not be" in body["message"] and "metadata" not in body["message"]


def test_expected_errors_log_one_line_without_traceback(
    admin_standalone: AdminStandalone, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pigeon.broker._admin"):
        admin_standalone.http_call("GET", f"{T}/missing-for-log/stats")
        admin_standalone.http_call("PUT", f"{API}/tenants/public")
        admin_standalone.http_call("PATCH", f"{API}/namespaces/public/default/policies", raw=b"[")
    records = [r for r in caplog.records if r.name == "pigeon.broker._admin"]
    assert len(records) == 3
    assert all(r.exc_info is None and r.levelno == logging.INFO for r in records)
    assert "status=404 error=TopicNotFound" in records[0].getMessage()
    assert "status=409 error=NodeExists" in records[1].getMessage()


def test_dashboard_files_are_served(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    status, page, headers = s.http_call("GET", "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/dashboard.js">' in page
    assert "http://" not in page and "https://" not in page  # nothing from a CDN
    status, js, headers = s.http_call("GET", "/dashboard/dashboard.js")
    assert status == 200 and "javascript" in headers["content-type"] and "/admin/v2" in js
    assert s.http_call("GET", "/dashboard/dashboard.css")[0] == 200
    assert s.http_call("GET", "/dashboard/secrets.txt")[0] == 404
    assert s.http_call("GET", "/dashboard/..%2F_admin.py")[0] == 404
    status, page, _ = s.http_call("GET", "/")  # redirects to the dashboard
    assert status == 200 and "PigeonMQ dashboard" in page


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _value(fams: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    for lbls, value in fams.get(name, []):
        if all(lbls.get(k) == v for k, v in labels.items()):
            return value
    raise AssertionError(f"no sample {name} {labels}")


def test_metrics_exposition(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    topic = "persistent://public/default/metrics-topic"
    with Client(s.service_url) as client, client.create_producer(topic) as producer:
        producer.send(b"first")  # loads the topic
        for i in range(4):
            producer.send(f"m{i}".encode())
        with client.subscribe(topic, "metrics-sub", initial_position="earliest") as consumer:
            for _ in range(3):
                consumer.acknowledge(consumer.receive(timeout=10))
            deadline = time.monotonic() + 10
            while True:
                status, text, headers = s.http_call("GET", "/metrics")
                fams = _families(text)
                if (
                    _value(fams, "pigeon_subscription_backlog_messages", subscription="metrics-sub")
                    == 2
                ):
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert _value(fams, "pigeon_subscription_consumers", subscription="metrics-sub") == 1
            assert _value(fams, "pigeon_broker_connections") >= 1
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert _value(fams, "pigeon_topic_messages_in_total", topic=topic) == 5
    assert _value(fams, "pigeon_topic_bytes_in_total", topic=topic) > 0
    assert _value(fams, "pigeon_subscription_messages_out_total", topic=topic) == 5
    assert _value(fams, "pigeon_topic_storage_size_bytes", topic=topic) > 0
    assert _value(fams, "pigeon_topic_segments", topic=topic) >= 1
    assert _value(fams, "pigeon_topic_producers", topic=topic) == 1
    assert _value(fams, "pigeon_topic_cache_hits_total", topic=topic) >= 1
    assert "pigeon_topic_cache_misses_total" in fams
    assert _value(fams, "pigeon_subscription_backlog_bytes", subscription="metrics-sub") > 0
    # every append is timed, from the topic's first (the ledger keeps the histogram)
    assert _value(fams, "pigeon_publish_latency_seconds_count", topic=topic) == 5
    assert _value(fams, "pigeon_publish_latency_seconds_bucket", topic=topic, le="+Inf") == 5
    assert _value(fams, "pigeon_publish_latency_seconds_sum", topic=topic) > 0
    assert _value(fams, "pigeon_broker_bookies", state="writable") == 1
    assert "pigeon_broker_msg_rate_in" in fams
    assert "pigeon_broker_process_cpu_seconds_total" in fams


def test_rates_show_up_in_stats(admin_standalone: AdminStandalone) -> None:
    s = admin_standalone
    topic = "rates-topic"
    deadline = time.monotonic() + 15
    with Client(s.service_url) as client, client.create_producer(topic) as producer:
        while True:
            for _ in range(20):
                producer.send_async(b"x" * 100)
            producer.flush()
            stats = s.http_call("GET", f"{T}/{topic}/stats")[1]
            if stats["msg_rate_in"] > 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
    assert stats["msg_throughput_in"] > stats["msg_rate_in"]  # > 100 bytes each
    load = s.http_call("GET", f"{API}/brokers")[1][0]["broker"]
    assert s.http_call("GET", f"{API}/brokers/{load}/load")[1]["topics"] >= 1
    samples = s.http_call("GET", f"{API}/broker-stats/throughput")[1]
    assert any(x["msg_rate_in"] > 0 for x in samples)


def test_support_server_answers_and_stops_cleanly(tmp_path: Path) -> None:
    server = AdminStandalone(tmp_path / "data").start()
    try:
        status, body, _ = server.http_call("GET", "/admin/v2/cluster/health")
        assert status == 200
        assert body["status"] == "ok"
        assert body["brokers"][0]["service_url"] == server.service_url
    finally:
        server.stop()
