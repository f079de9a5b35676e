"""Kafka helpers of the integration tests: a ``pigeon standalone`` with a ``[kafka]``
config, unique topic names, and confluent-kafka producing and consuming.

Every wait is bounded (:data:`DEADLINE_S` unless told otherwise).  confluent-kafka is
imported where it is used: a module that needs it skips with ``importorskip`` first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pigeon.core.testing.servers import Standalone, port_open

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
    for r in records:
        producer.produce(topic, on_delivery=lambda err, msg: reports.append((err, msg)), **r)
        producer.poll(0)
    assert producer.flush(DEADLINE_S) == 0, "deliveries still pending"
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


class Security:
    """Certificates (trustme: a CA, the broker's for 127.0.0.1, client certificates
    by common name), a token secret key and tokens, written under ``base``."""

    def __init__(self, base: Path) -> None:
        import trustme

        from pigeon.core.tokens import create_secret_key

        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.ca = trustme.CA()
        self.ca_file = base / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.cert_file, self.key_file = base / "broker.pem", base / "broker.key"
        server.cert_chain_pems[0].write_to_path(str(self.cert_file))
        server.private_key_pem.write_to_path(str(self.key_file))
        self.secret = create_secret_key()
        self.secret_file = base / "secret.key"
        self.secret_file.write_bytes(self.secret)
        self.secret_file.chmod(0o600)

    def token(self, role: str, *, expiry_s: int | None = None) -> str:
        from pigeon.core.tokens import create_token

        return create_token(role, self.secret, expiry_s=expiry_s)

    def client_cert(self, role: str) -> tuple[Path, Path]:
        """(certificate file, key file) of a client certificate whose CN is ``role``."""
        cert = self.ca.issue_cert(f"{role}.clients.test", common_name=role)
        cert_file, key_file = self.base / f"{role}.pem", self.base / f"{role}.key"
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        return cert_file, key_file

    def config(
        self,
        security_protocol: str,
        *,
        superusers: Iterable[str] = ("admin",),
        providers: Iterable[str] = ("token",),
        mtls: bool = False,
        authentication: bool = True,
        extra_kafka: str = "",
    ) -> str:
        """A standalone's TOML: authentication (tokens), authorization, TLS and the
        ``[kafka]`` listener's ``security_protocol``."""
        providers_toml = ", ".join(f'"{p}"' for p in providers)
        superusers_toml = ", ".join(f'"{r}"' for r in superusers)
        return f"""
[broker]
authentication_enabled = {str(authentication).lower()}
authentication_providers = [{providers_toml}]
token_secret_key = "file://{self.secret_file}"
authorization_enabled = true
superuser_roles = [{superusers_toml}]
tls_certificate_file = "{self.cert_file}"
tls_key_file = "{self.key_file}"
tls_trust_certs_file = "{self.ca_file}"
tls_require_trusted_client_cert = {str(mtls).lower()}

[kafka]
group_initial_rebalance_delay_ms = 300
default_partitions = 1
security_protocol = "{security_protocol}"
{extra_kafka}
"""

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
