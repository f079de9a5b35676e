"""Cluster mode with real processes: bookies and brokers on one metadata store.

Every test runs once per metadata backend — the embedded store (shared by the
processes), a real ZooKeeper and a real etcd — times each replication policy: the
built-in ``quorum`` and the ``leader-follower`` plugin (test ids ``quorum`` and ``lf``).
``nox -s cluster`` runs one session per (metadata, replication) pair, every cell
(``PIGEON_CLUSTER_MATRIX=full``).  ``nox -s tests`` (CI) runs the tests marked
``ci_cells`` on three of their six cells, deselecting the others at collection
(``integration/conftest.py``): ``CELLS_A`` or ``CELLS_B``, each covering the three
backends and both policies, alternated so that every cell still runs in CI.

A history checker records every acknowledged send and every received message and checks
that no acknowledged message is missing, that each producer's order holds, and (with
de-duplication) that nothing is stored twice — while the broker owning the topic is
killed with SIGKILL in the middle of production.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import Cluster

from pigeon.client import Client, Timeout
from pigeon.core.testing.servers import etcd_server, zookeeper_server

pytestmark = pytest.mark.integration

SESSION_TIMEOUT = 2.0
OP_TIMEOUT = 30.0

METADATA_BACKENDS = ("embedded", "zookeeper", "etcd")
REPLICATION_IDS = ("quorum", "lf")
#: two complementary sets of cells (ids ``<metadata>-<replication>``): each has every
#: metadata backend and both replication policies, together they are the whole matrix
CELLS_A = ("embedded-quorum", "zookeeper-lf", "etcd-quorum")
CELLS_B = ("embedded-lf", "zookeeper-quorum", "etcd-lf")
for _cells in (CELLS_A, CELLS_B):
    assert {c.split("-")[0] for c in _cells} == set(METADATA_BACKENDS), _cells
    assert {c.split("-")[1] for c in _cells} == set(REPLICATION_IDS), _cells
assert sorted(CELLS_A + CELLS_B) == sorted(
    f"{m}-{r}" for m in METADATA_BACKENDS for r in REPLICATION_IDS
)


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory: pytest.TempPathFactory):
    with zookeeper_server(tmp_path_factory.mktemp("zk")) as server:
        yield server


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def embedded_url(tmp_path: Path) -> str:
    """The URL of an embedded metadata store in ``tmp_path`` (the processes share it)."""
    return f"embedded://{tmp_path / 'metadata'}?session_timeout={SESSION_TIMEOUT}"


@contextlib.contextmanager
def started_cluster(
    tmp_path: Path,
    metadata_url: str,
    replication: str = "quorum",
    *,
    bookies: int = 1,
    brokers: int = 1,
    broker_config: str = "",
) -> Iterator[Cluster]:
    """``bookies`` bookies, then ``brokers`` brokers with the ``[broker]`` lines
    ``broker_config`` (in ``tmp_path / "broker.toml"``); every process killed on exit."""
    args: list[str] = []
    if broker_config:
        config = tmp_path / "broker.toml"
        config.write_text("[broker]\n" + broker_config)
        args = ["--config", str(config)]
    cluster = Cluster(tmp_path, metadata_url, replication)
    try:
        for _ in range(bookies):
            cluster.add_bookie()
        for _ in range(brokers):
            cluster.add_broker(*args)
        yield cluster
    finally:
        cluster.kill_all()


@pytest.fixture(params=METADATA_BACKENDS)
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh metadata namespace per test on the backend the test is parametrized with."""
    chroot = f"/t{uuid.uuid4().hex[:12]}"
    if request.param == "zookeeper":
        return str(
            request.getfixturevalue("zookeeper").url(chroot, session_timeout=SESSION_TIMEOUT)
        )
    if request.param == "etcd":
        return str(request.getfixturevalue("etcd").url(chroot, session_timeout=SESSION_TIMEOUT))
    return embedded_url(tmp_path)


@pytest.fixture(
    params=[pytest.param("quorum", id="quorum"), pytest.param("leader-follower", id="lf")]
)
def replication(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(tmp_path: Path, metadata_url: str, replication: str):
    """Two bookies, every entry on both (E = Qw = Qa = 2), two brokers."""
    quorums = "ensemble_size = 2\nwrite_quorum = 2\nack_quorum = 2\n"
    with started_cluster(
        tmp_path, metadata_url, replication, bookies=2, brokers=2, broker_config=quorums
    ) as c:
        yield c


class History:
    """Acknowledged sends and received messages of one producer."""

    def __init__(self) -> None:
        self.acked: set[int] = set()
        self.failed = 0
        self.lock = threading.Lock()

    def wait_acked(self, count: int, *, within: float) -> None:
        """Until ``count`` sends are acknowledged, or ``within`` seconds passed (the
        caller asserts what it needs)."""
        deadline = time.monotonic() + within
        while len(self.acked) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def check(self, received: list[int]) -> None:
        missing = self.acked - set(received)
        assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
        assert len(received) == len(set(received)), "a message was stored twice"
        assert received == sorted(received), "producer order was not kept"


def produce_in_background(
    client: Client, topic: str, history: History, stop: threading.Event
) -> threading.Thread:
    producer = client.create_producer(topic, producer_name="history", batching_max_delay_ms=2)

    def run() -> None:
        i = 0
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            fut = producer.send_async(str(i).encode())

            def done(f, i=i):  # type: ignore[no-untyped-def]
                with history.lock:
                    if f.exception() is None:
                        history.acked.add(i)
                    else:
                        history.failed += 1

            fut.add_done_callback(done)
            i += 1
            if i % 20 == 0:
                time.sleep(0.01)
        producer.flush()
        producer.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def read_all(client: Client, topic: str) -> list[int]:
    out: list[int] = []
    with client.subscribe(topic, "checker", initial_position="earliest") as consumer:
        while True:
            try:
                msgs = consumer.batch_receive(1000, timeout=3)
            except Timeout:
                return out
            out.extend(int(m.value) for m in msgs)


def owner_of(client: Client, topic: str) -> str:
    with client.create_producer(topic) as producer:
        return producer._handle.engines[0].conn.name


@pytest.mark.ci_cells(*CELLS_A)
def test_killing_the_owning_broker_loses_no_acknowledged_message(cluster: Cluster) -> None:
    history = History()
    stop = threading.Event()
    with Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client:
        owner = owner_of(client, "failover")
        thread = produce_in_background(client, "failover", history, stop)
        history.wait_acked(1000, within=20)
        acked_before = len(history.acked)
        assert acked_before >= 1000, "production did not start"
        victim = next(b for b in cluster.brokers if b.address == owner)
        victim.kill9()
        # production carries on through the other broker once the session expired
        history.wait_acked(acked_before + 2000, within=30)
        stop.set()
        thread.join(60)
        assert len(history.acked) >= acked_before + 2000, "production did not resume"
        survivor = next(b for b in cluster.brokers if b is not victim)
        assert owner_of(client, "failover") == survivor.address
        history.check(read_all(client, "failover"))


@pytest.mark.ci_cells(*CELLS_B)
def test_any_broker_answers_lookups_and_names_the_owner(cluster: Cluster) -> None:
    first, second = cluster.brokers
    with (
        Client(f"pigeon://{second.address}", operation_timeout=OP_TIMEOUT) as via_second,
        via_second.create_producer("lookup-me") as producer,
    ):
        producer.send(b"x")
        owner = producer._handle.engines[0].conn.name
    with (
        Client(f"pigeon://{first.address}", operation_timeout=OP_TIMEOUT) as via_first,
        via_first.subscribe("lookup-me", "s", initial_position="earliest") as consumer,
    ):
        assert consumer.receive(timeout=10).value == b"x"
        assert consumer._handle.engines[0].conn.name == owner


@pytest.mark.ci_cells(*CELLS_A)
def test_whole_cluster_restart_keeps_data_and_cursors(cluster: Cluster) -> None:
    with Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer("restart") as producer:
            for i in range(500):
                producer.send_async(str(i).encode())
            producer.flush()
        with client.subscribe("restart", "s", initial_position="earliest") as consumer:
            for _ in range(200):
                consumer.acknowledge(consumer.receive(timeout=10))
    cluster.kill_all()
    for node in [*cluster.bookies, *cluster.brokers]:
        node.start()
    with (
        Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client,
        client.subscribe("restart", "s") as consumer,
    ):
        first = consumer.receive(timeout=20)
        assert int(first.value) == 200


@pytest.fixture
def replicated_cluster(tmp_path: Path, metadata_url: str, replication: str):
    """Three bookies, every entry on all three, acknowledged by two; one broker."""
    quorums = "ensemble_size = 3\nwrite_quorum = 3\nack_quorum = 2\n"
    with started_cluster(
        tmp_path, metadata_url, replication, bookies=3, broker_config=quorums
    ) as c:
        yield c


@pytest.mark.ci_cells(*CELLS_B)
def test_killing_a_bookie_of_three_keeps_production_going(replicated_cluster: Cluster) -> None:
    cluster = replicated_cluster
    history = History()
    stop = threading.Event()
    with Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client:
        thread = produce_in_background(client, "replicated", history, stop)
        history.wait_acked(1000, within=20)
        assert len(history.acked) >= 1000, "production did not start"
        # the bookie with the lowest address: with leader-follower it leads the segment
        # (ensembles of idle bookies are chosen by address), so a new leader is elected
        min(cluster.bookies, key=lambda b: b.address).kill9()
        before = len(history.acked)
        # Qa = 2 of the two survivors: acknowledged writes go on at once...
        history.wait_acked(before + 1000, within=20)
        assert len(history.acked) >= before + 1000, "production stalled after a bookie died"
        # ...and a replacement bookie joins the ensemble (ensemble change)
        cluster.add_bookie()
        middle = len(history.acked)
        history.wait_acked(middle + 1000, within=20)
        stop.set()
        thread.join(60)
        assert history.failed == 0, f"{history.failed} sends failed"
        history.check(read_all(client, "replicated"))


def test_auditor_re_replicates_what_a_lost_bookie_held(tmp_path: Path, replication: str) -> None:
    """After the grace period the data of a dead bookie is copied to another bookie: the
    two remaining original replicas can then die too and everything is still readable."""
    config = (
        "ensemble_size = 3\nwrite_quorum = 3\nack_quorum = 2\n"
        "segment_max_entries = 20\nauditor_grace_period_s = 1.0\nauditor_interval_s = 0.5\n"
    )
    with (
        started_cluster(
            tmp_path, embedded_url(tmp_path), replication, bookies=3, broker_config=config
        ) as cluster,
        Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client,
    ):
        with client.create_producer("audited", batching_max_messages=10) as producer:
            for i in range(600):
                producer.send_async(str(i).encode())
            producer.flush()
        lost = cluster.bookies[1]
        lost.kill9()
        cluster.add_bookie()  # the spare the auditor copies to
        deadline = time.monotonic() + 60
        broker_log = tmp_path / "broker-0.log"
        while time.monotonic() < deadline:
            if "under-replicated fragments=0" in broker_log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("auditor did not finish:\n" + cluster.brokers[0].log_tail())
        assert "re-replicated segment=" in broker_log.read_text(errors="replace")
        # Only the copy made by the auditor is left for the entries of closed segments
        # that lived on the lost bookie and the two others.
        cluster.bookies[0].kill9()
        cluster.bookies[2].kill9()
        got: list[int] = []
        with client.create_reader("audited", "earliest") as reader:
            while len(got) < 600:
                try:
                    got.append(int(reader.read_next(timeout=10).value))
                except Timeout:
                    break
        # the open segment (still on the dead bookies) may hold the last few
        assert got == list(range(len(got)))
        assert len(got) >= 580, f"only {len(got)} of 600 readable from the copy"


@pytest.mark.parametrize("backend", ["zookeeper", "etcd"])
def test_restarting_the_metadata_server_keeps_the_cluster_going(
    backend: str, replication: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server = request.getfixturevalue(backend)
    url = server.url(f"/t{uuid.uuid4().hex[:12]}", session_timeout=10)
    history = History()
    stop = threading.Event()
    with (
        started_cluster(tmp_path, url, replication) as cluster,
        Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client,
    ):
        thread = produce_in_background(client, "through-restart", history, stop)
        history.wait_acked(500, within=20)
        server.restart(kill=True)
        before = len(history.acked)
        history.wait_acked(before + 1000, within=30)
        stop.set()
        thread.join(60)
        assert len(history.acked) >= before + 1000, "production did not carry on"
        # new metadata work after the restart: a new topic needs ownership + a ledger
        with client.create_producer("after-restart") as producer:
            producer.send(b"ok", timeout=OP_TIMEOUT)
        history.check(read_all(client, "through-restart"))


def test_load_manager_sheds_bundles_to_an_idle_broker(tmp_path: Path) -> None:
    config = "load_manager_interval_s = 0.5\n"
    with started_cluster(tmp_path, embedded_url(tmp_path), broker_config=config) as cluster:
        (first,) = cluster.brokers
        topics = [f"load-{i}" for i in range(16)]
        with Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client:
            for t in topics:
                with client.create_producer(t) as producer:
                    producer.send(b"x")
        second = cluster.add_broker("--config", str(tmp_path / "broker.toml"))
        deadline = time.monotonic() + 30
        owners: set[str] = set()
        while time.monotonic() < deadline:
            with Client(f"pigeon://{second.address}", operation_timeout=OP_TIMEOUT) as client:
                owners = set()
                for t in topics:
                    with client.create_producer(t) as producer:
                        owners.add(producer._handle.engines[0].conn.name)
                        producer.send(b"y")
            if second.address in owners:
                break
            time.sleep(0.5)
        assert owners == {first.address, second.address}, f"no bundle moved: {owners}"
        with Client(cluster.service_url, operation_timeout=OP_TIMEOUT) as client:
            for t in topics:
                with client.subscribe(t, "check", initial_position="earliest") as consumer:
                    values = {consumer.receive(timeout=10).value for _ in range(2)}
                    assert values >= {b"x"}
