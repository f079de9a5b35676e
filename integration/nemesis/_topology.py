"""The nemesis cluster: a metadata server, 3 bookies and 2 brokers behind black-hole proxies.

Every bookie and broker has a :class:`~._proxy.Proxy` in front of it, and every node
reaches a ZooKeeper/etcd server through a proxy of its own, so that cutting a node
(:meth:`Topology.cut`) isolates it: nobody reaches it and it reaches no metadata.

* **Bookies** advertise their proxy (``advertised_address`` in ``[bookie]``): brokers, and
  with leader-follower the leader bookie, reach every bookie only through its proxy.
* **Brokers** cannot advertise another address than the one they bind (``BrokerConfig``
  has no ``advertised_address``): a lookup answers the real address.  The clients of the
  test process are given the proxies as their service URL, and :func:`routed_lookups`
  maps the looked-up real addresses to the proxies, so client-to-broker links do cross
  the proxies.  Brokers do not talk to each other over the binary protocol.
* The **embedded** metadata store is a directory shared by the processes: there is no
  link to cut and no server to kill or pause.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from _cluster import Node, bookie_args, broker_args

from pigeon.core.testing.servers import (
    EtcdServer,
    ZooKeeperServer,
    free_ports,
    merge_tables,
    toml_text,
)

from ._proxy import Proxy, ProxyHub

__all__ = ["BOOKIES", "BROKERS", "NAMESPACE", "SESSION_TIMEOUT", "Topology", "routed_lookups"]

BOOKIES = 3
BROKERS = 2
#: metadata session timeout of every node (seconds): faults of 2-4 s cross it or not
SESSION_TIMEOUT = 3.0
#: the workload's namespace: retention forever, so that the final read sees every message
NAMESPACE = "public/nemesis"
BROKER_CONFIG = {"broker": {"ensemble_size": 3, "write_quorum": 2, "ack_quorum": 2}}


class Topology:
    """Starts and owns every process of one nemesis run (stop with :meth:`stop`)."""

    def __init__(
        self,
        root: Path,
        metadata: str,
        replication: str,
        hub: ProxyHub,
        *,
        config: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.root = root
        self.metadata = metadata
        self.replication = replication
        self.hub = hub
        #: TOML tables merged into every node's configuration (e.g. the security keys of
        #: ``SecurityFiles.node_table()`` in [broker] and [bookie])
        self.config = config or {}
        self.server: ZooKeeperServer | EtcdServer | None = None
        self.nodes: dict[str, Node] = {}
        #: node name -> the proxy in front of it / its proxy to the metadata server
        self.inbound: dict[str, Proxy] = {}
        self.metadata_link: dict[str, Proxy] = {}
        self.http_ports: dict[str, int] = {}
        #: broker name -> the proxy in front of its Kafka listener (which it advertises)
        self.kafka_inbound: dict[str, Proxy] = {}
        self._chroot = f"/n{uuid.uuid4().hex[:10]}"

    # ------------------------------------------------------------------ start / stop

    def start(self) -> Topology:
        if self.metadata == "zookeeper":
            self.server = ZooKeeperServer(self.root / "zookeeper")
        elif self.metadata == "etcd":
            self.server = EtcdServer(self.root / "etcd")
        elif self.metadata != "embedded":
            raise ValueError(f"unknown metadata backend {self.metadata!r}")
        if self.server is not None:
            self.server.start()
        for i in range(BOOKIES):
            self._add_bookie(f"bookie-{i}")
        for i in range(BROKERS):
            self._add_broker(f"broker-{i}")
        self._admin(
            "PUT",
            f"/admin/v2/namespaces/{NAMESPACE}",
            {"retention_time_s": -1, "retention_size_mb": -1},
        )
        return self

    def _metadata_url(self, name: str) -> str:
        if self.server is None:
            return f"embedded://{self.root / 'metadata'}?session_timeout={SESSION_TIMEOUT}"
        link = self.hub.add(f"{name}->metadata", self.server.port)
        self.metadata_link[name] = link
        scheme = "zk" if self.metadata == "zookeeper" else "etcd"
        return f"{scheme}://{link.address}{self._chroot}?session_timeout={SESSION_TIMEOUT}"

    def _add_bookie(self, name: str) -> None:
        (port,) = free_ports(1)
        proxy = self.inbound[name] = self.hub.add(name, port)
        config = self.root / f"{name}.toml"
        own = {"bookie": {"advertised_address": proxy.address}}
        config.write_text(toml_text(merge_tables(own, self.config)))
        args = bookie_args(
            self._metadata_url(name), port, self.root / name, "--config", str(config)
        )
        node = self.nodes[name] = Node("bookie", args, port, self.root / f"{name}.log")
        node.start()

    def _add_broker(self, name: str) -> None:
        port, http_port, kafka_port = free_ports(3)
        self.inbound[name] = self.hub.add(name, port)
        kafka = self.kafka_inbound[name] = self.hub.add(f"{name}-kafka", kafka_port)
        self.http_ports[name] = http_port
        own = self.root / f"{name}.toml"
        listener = {
            "port": kafka_port,
            "namespace": NAMESPACE,
            "advertised_port": kafka.port,
            "group_initial_rebalance_delay_ms": 0,
        }
        own.write_text(toml_text(merge_tables(BROKER_CONFIG, {"kafka": listener}, self.config)))
        args = broker_args(
            self._metadata_url(name), port, http_port, self.replication, "--config", str(own)
        )
        node = self.nodes[name] = Node("broker", args, port, self.root / f"{name}.log")
        node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            self._signal(node, signal.SIGCONT)
            node.kill9()
        if self.server is not None:
            self._signal_server(signal.SIGCONT)
            self.server.stop(kill=True)

    # ------------------------------------------------------------------ addresses

    @property
    def brokers(self) -> list[str]:
        return [n for n in self.nodes if n.startswith("broker")]

    @property
    def bookies(self) -> list[str]:
        return [n for n in self.nodes if n.startswith("bookie")]

    @property
    def service_url(self) -> str:
        """The brokers' proxies: what clients of the run connect to."""
        return "pigeon://" + ",".join(self.inbound[b].address for b in self.brokers)

    @property
    def kafka_bootstrap(self) -> str:
        """The brokers' Kafka listeners' proxies (what the brokers advertise)."""
        return ",".join(self.kafka_inbound[b].address for b in self.brokers)

    @property
    def routes(self) -> dict[tuple[str, int], tuple[str, int]]:
        """Real broker address -> its proxy (see :func:`routed_lookups`)."""
        return {
            ("127.0.0.1", self.nodes[b].port): ("127.0.0.1", self.inbound[b].port)
            for b in self.brokers
        }

    # ------------------------------------------------------------------ faults

    def kill(self, name: str) -> None:
        if name == "metadata":
            assert self.server is not None
            self._signal_server(signal.SIGCONT)
            self.server.stop(kill=True)
        else:
            node = self.nodes[name]
            self._signal(node, signal.SIGCONT)
            node.kill9()

    def start_node(self, name: str) -> None:
        if name == "metadata":
            assert self.server is not None
            if not self.server.running:
                self.server.start()
        elif not self.running(name):
            node = self.nodes[name]
            node.kill9()  # reaps a dead process and closes the log a failed start left open
            node.start()

    def running(self, name: str) -> bool:
        if name == "metadata":
            return self.server is not None and self.server.running
        proc = self.nodes[name].proc
        return proc is not None and proc.poll() is None

    def exit_code(self, name: str) -> int | None:
        proc = self.server.proc if name == "metadata" else self.nodes[name].proc  # type: ignore[union-attr]
        return None if proc is None else proc.poll()

    def pause(self, name: str) -> None:
        self._signal_name(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self._signal_name(name, signal.SIGCONT)

    def cut(self, name: str) -> None:
        """Black-hole every link of ``name``: its inbound proxies and its metadata link."""
        self.inbound[name].block()
        if name in self.kafka_inbound:
            self.kafka_inbound[name].block()
        if name in self.metadata_link:
            self.metadata_link[name].block()

    def heal(self, name: str) -> None:
        self.inbound[name].heal()
        if name in self.kafka_inbound:
            self.kafka_inbound[name].heal()
        if name in self.metadata_link:
            self.metadata_link[name].heal()

    def heal_all(self) -> None:
        """SIGCONT everything and open every proxy (starting stopped nodes is the caller's)."""
        self.hub.heal_all()
        for node in self.nodes.values():
            self._signal(node, signal.SIGCONT)
        self._signal_server(signal.SIGCONT)

    def _signal_name(self, name: str, sig: signal.Signals) -> None:
        if name == "metadata":
            self._signal_server(sig)
        else:
            self._signal(self.nodes[name], sig)

    @staticmethod
    def _signal(node: Node, sig: signal.Signals) -> None:
        if node.proc is not None and node.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.proc.pid, sig)

    def _signal_server(self, sig: signal.Signals) -> None:
        proc = self.server.proc if self.server is not None else None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    # ------------------------------------------------------------------ admin API

    def topic_stats(self, topic: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """``GET .../stats`` of ``topic`` (of the workload's namespace) from the first
        broker that answers (the owner: others answer 409), or None."""
        path = f"/admin/v2/topics/persistent/{NAMESPACE}/{topic}/stats"
        for name in self.brokers:
            if not self.running(name):
                continue
            try:
                return dict(self._request(name, "GET", path, None, timeout))
            except (OSError, ValueError, http.client.HTTPException):
                continue
        return None

    def _admin(self, method: str, path: str, body: Any) -> Any:
        """An admin call on the first broker that accepts it (the cluster is healthy;
        a broker's HTTP port opens just after its service port: tried for up to 30 s)."""
        errors: list[str] = []
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            errors = []
            for name in self.brokers:
                try:
                    return self._request(name, method, path, body, 10.0)
                except (OSError, ValueError) as exc:
                    errors.append(f"{name}: {exc}")
            time.sleep(0.2)
        raise AssertionError(f"admin {method} {path} failed: {errors}")

    def _request(self, name: str, method: str, path: str, body: Any, timeout: float) -> Any:
        url = f"http://127.0.0.1:{self.http_ports[name]}{path}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read() or b"null")

    def log_tail(self, name: str, lines: int = 20) -> str:
        if name == "metadata":
            return self.server.log_tail(lines) if self.server is not None else ""
        return self.nodes[name].log_tail(lines)


@contextlib.contextmanager
def routed_lookups(routes: dict[tuple[str, int], tuple[str, int]]) -> Iterator[None]:
    """Clients of this process reach a looked-up broker through its proxy.

    A lookup answers the broker's bound address; the client engine turns that URL into
    an address with ``parse_service_url``, which this replaces for the duration.
    """
    from pigeon.client import _engine

    original = _engine.parse_service_url

    def routed(url: str) -> tuple[str, int]:
        address = original(url)
        return routes.get(address, address)

    _engine.parse_service_url = routed
    try:
        yield
    finally:
        _engine.parse_service_url = original
