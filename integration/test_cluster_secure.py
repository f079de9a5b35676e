"""Cluster failover with TLS + tokens + authorization on every link (real processes).

The cluster of :class:`_cluster.Cluster` with ``security=``: bookies serve TLS and admit
only the nodes' role, brokers reach them (and leader-follower bookies each other) over
TLS with a token, clients speak ``pigeon+ssl://`` with a token of an application role
that was granted ``produce`` and ``consume`` on the namespace over HTTPS (not a
superuser).  A broker or a bookie is killed with SIGKILL in the middle of production:
the clients resume over TLS and nothing acknowledged is lost (the history checks of
``test_cluster_failover``).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import Cluster, Node
from test_cluster_failover import (
    OP_TIMEOUT,
    History,
    embedded_url,
    produce_in_background,
    read_all,
)

from pigeon.client import AuthenticationToken, Client
from pigeon.core.errors import AuthenticationError
from pigeon.core.testing.servers import SecurityFiles

pytestmark = pytest.mark.integration

#: the application's role: produce + consume on public/default, nothing more
APP = "orders-app"
#: the operator's role (a superuser) for the admin calls over HTTPS
ADMIN = "operator"
NAMESPACE = "public/default"


@contextlib.contextmanager
def secure_cluster(
    tmp_path: Path,
    replication: str,
    *,
    bookies: int,
    brokers: int,
    quorums: tuple[int, int, int],
) -> Iterator[tuple[Cluster, SecurityFiles]]:
    security = SecurityFiles.create(tmp_path / "security")
    e, w, a = quorums
    cluster = Cluster(
        tmp_path,
        embedded_url(tmp_path),
        replication,
        config={"broker": {"ensemble_size": e, "write_quorum": w, "ack_quorum": a}},
        security=security,
        admin_roles=(ADMIN,),
    )
    try:
        for _ in range(bookies):
            cluster.add_bookie()
        for _ in range(brokers):
            cluster.add_broker()
        _grant(cluster.brokers[0], security)
        yield cluster, security
    finally:
        cluster.kill_all()


def _grant(broker: Node, security: SecurityFiles) -> None:
    """``POST .../permissions/APP`` over HTTPS with the operator's token."""
    request = urllib.request.Request(
        f"https://127.0.0.1:{broker.https_port}/admin/v2/namespaces/{NAMESPACE}/permissions/{APP}",
        data=json.dumps(["produce", "consume"]).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {security.token(ADMIN)}",
        },
    )
    context = ssl.create_default_context(cafile=str(security.ca_file))
    with urllib.request.urlopen(request, timeout=OP_TIMEOUT, context=context) as answer:
        assert answer.status == 204


def app_client(cluster: Cluster, security: SecurityFiles) -> Client:
    return Client(
        cluster.service_url,
        operation_timeout=OP_TIMEOUT,
        authentication=AuthenticationToken(security.token(APP)),
        tls_trust_certs_file_path=str(security.ca_file),
    )


def owner_of(client: Client, topic: str) -> str:
    with client.create_producer(topic) as producer:
        return str(producer._handle.engines[0].conn.name)


def assert_secured(cluster: Cluster, security: SecurityFiles) -> None:
    """Every bookie served TLS with tokens, nothing was denied, and a client without a
    token is refused by the TLS port."""
    for bookie in cluster.bookies:
        assert "tls=True authentication=token" in bookie.log_path.read_text(errors="replace")
    for broker in cluster.brokers:
        assert "authorization denied" not in broker.log_path.read_text(errors="replace")
    anonymous = Client(
        cluster.service_url,
        operation_timeout=5,
        tls_trust_certs_file_path=str(security.ca_file),
    )
    with anonymous, pytest.raises(AuthenticationError):
        anonymous.create_producer("anonymous")


def test_killing_the_owning_broker_over_tls_loses_no_acknowledged_message(
    tmp_path: Path,
) -> None:
    with (
        secure_cluster(tmp_path, "quorum", bookies=2, brokers=2, quorums=(2, 2, 2)) as (
            cluster,
            security,
        ),
        app_client(cluster, security) as client,
    ):
        history = History()
        stop = threading.Event()
        owner = owner_of(client, "failover")
        victim = next(b for b in cluster.brokers if owner in (b.address, b.tls_address))
        thread = produce_in_background(client, "failover", history, stop)
        history.wait_acked(1000, within=20)
        acked_before = len(history.acked)
        assert acked_before >= 1000, "production did not start"
        victim.kill9()
        # production carries on over TLS through the other broker
        history.wait_acked(acked_before + 2000, within=30)
        stop.set()
        thread.join(60)
        assert len(history.acked) >= acked_before + 2000, "production did not resume"
        survivor = next(b for b in cluster.brokers if b is not victim)
        assert owner_of(client, "failover") in (survivor.address, survivor.tls_address)
        history.check(read_all(client, "failover"))
        assert_secured(cluster, security)


def test_killing_the_leader_bookie_over_tls_keeps_production_going(tmp_path: Path) -> None:
    """Leader-follower: the leader bookie forwards to its followers over TLS with the
    nodes' token; killing it elects a new leader and production goes on."""
    with (
        secure_cluster(tmp_path, "leader-follower", bookies=3, brokers=1, quorums=(3, 3, 2)) as (
            cluster,
            security,
        ),
        app_client(cluster, security) as client,
    ):
        history = History()
        stop = threading.Event()
        thread = produce_in_background(client, "replicated", history, stop)
        history.wait_acked(1000, within=20)
        assert len(history.acked) >= 1000, "production did not start"
        # the bookie with the lowest address leads the segment (see test_cluster_failover)
        min(cluster.bookies, key=lambda b: b.address).kill9()
        before = len(history.acked)
        history.wait_acked(before + 1000, within=20)
        assert len(history.acked) >= before + 1000, "production stalled after a bookie died"
        cluster.add_bookie()  # a replacement joins the ensemble, over TLS too
        middle = len(history.acked)
        history.wait_acked(middle + 1000, within=20)
        stop.set()
        thread.join(60)
        assert history.failed == 0, f"{history.failed} sends failed"
        history.check(read_all(client, "replicated"))
        assert_secured(cluster, security)
