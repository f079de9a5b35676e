"""A standalone (broker + bookie + embedded metadata) with its admin server, run by trio on a
background thread, so synchronous tests (click's CliRunner, HTTP clients, schemathesis)
can talk to it over loopback and still reach into the broker with :meth:`call`.

The ``admin_standalone`` fixture (``conftest.py``) runs one per test module."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, BrokerService, run_standalone
from pigeon.broker._admin import serve_admin
from pigeon.client import Client
from pigeon.core.testing.fuzz import ServerThread


class AdminStandalone(ServerThread):
    def __init__(self, data_dir: Path, **broker_options: Any) -> None:
        super().__init__("admin-standalone")
        self.data_dir = data_dir
        self.broker_options = broker_options
        self.service: BrokerService | None = None
        self.http: tuple[str, int] | None = None

    async def serve(self, nursery: trio.Nursery) -> None:
        options: dict[str, Any] = {"maintenance_interval_s": 0.5, "cursor_persist_interval_ms": 20}
        if "http_port" in {f.name for f in dataclasses.fields(BrokerConfig)}:
            options["http_port"] = -1  # this helper serves the admin API itself (bound port)
        broker_config = BrokerConfig(port=0, **(options | self.broker_options))
        bookie_config = BookieConfig(port=0, fsync="never")
        self.service = await nursery.start(
            functools.partial(run_standalone, self.data_dir, broker_config, bookie_config)
        )
        self.http = await nursery.start(
            functools.partial(serve_admin, self.service, host="127.0.0.1", port=0)
        )

    # ------------------------------------------------------------------ access

    @property
    def url(self) -> str:
        assert self.http is not None
        return f"http://{self.http[0]}:{self.http[1]}"

    @property
    def service_url(self) -> str:
        assert self.service is not None
        return self.service.service_url

    @contextlib.contextmanager
    def consumer(self, topic: str, subscription: str, **options: Any) -> Iterator[Any]:
        """A consumer (the synchronous client) of ``subscription`` of ``topic`` from the
        earliest; ``options`` go to ``subscribe``."""
        with (
            Client(self.service_url) as client,
            client.subscribe(
                topic, subscription, initial_position="earliest", **options
            ) as consumer,
        ):
            yield consumer

    def seed_topic(self, topic: str, subscription: str) -> None:
        """Three messages (key ``k``) on ``topic`` of ``public/default``, and
        ``subscription`` on it at the earliest (none of them acknowledged)."""
        with Client(self.service_url) as client, client.create_producer(topic) as producer:
            for i in range(3):
                producer.send(f"value-{i}".encode(), key="k")
        path = f"/admin/v2/topics/persistent/public/default/{topic}/subscriptions/{subscription}"
        status, _, _ = self.http_call("PUT", path + "?position=earliest")
        assert status == 201

    def http_call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        """(status, decoded JSON or text, headers) of one request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, payload, rh = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, payload, rh = exc.code, exc.read(), dict(exc.headers)
        ctype = rh.get("content-type", rh.get("Content-Type", ""))
        if ctype.startswith("application/json") and payload:
            return status, json.loads(payload), rh
        return status, payload.decode("utf-8", errors="replace"), rh
