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

**Secure mode** (``Topology(..., security=SecurityFiles.create(dir))``): every link is
TLS and every caller shows a token.  Bookies serve TLS on their port and admit only the
nodes' role (a superuser); brokers dial bookies, and leader-follower bookies dial each
other, over TLS with that role's token (``broker_client_*``).  Brokers serve the native
protocol on ``broker_service_port_tls`` (their proxies front that port, lookups answer
``pigeon+ssl://``), the admin API over HTTPS on ``web_service_port_tls`` (the topology's
admin calls use it with the run's CA and a superuser token) and Kafka as ``SASL_SSL``.
Authorization is on: the workload's clients authenticate as :data:`APP_ROLE`, which is
granted only ``produce`` and ``consume`` on :data:`NAMESPACE`.  The plaintext ports the
node commands still bind (``--port``, ``--http-port``) require a token too; nothing of
the run dials them except the readiness probe (a TCP connect).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from _cluster import Node, bookie_args, broker_args

from pigeon.core.testing.servers import (
    NODE_ROLE,
    EtcdServer,
    SecurityFiles,
    ZooKeeperServer,
    free_ports,
    merge_tables,
    toml_text,
)

from ._proxy import Proxy, ProxyHub

__all__ = [
    "ADMIN_ROLE",
    "APP_ROLE",
    "BOOKIES",
    "BROKERS",
    "NAMESPACE",
    "SESSION_TIMEOUT",
    "Topology",
    "routed_lookups",
]

BOOKIES = 3
BROKERS = 2
#: metadata session timeout of every node (seconds): faults of 2-4 s cross it or not
SESSION_TIMEOUT = 3.0
#: the workload's namespace: retention forever, so that the final read sees every message
NAMESPACE = "public/nemesis"
BROKER_CONFIG = {"broker": {"ensemble_size": 3, "write_quorum": 2, "ack_quorum": 2}}
#: secure mode: the workload's role (granted produce + consume on NAMESPACE, nothing more)
APP_ROLE = "nemesis-app"
#: secure mode: the role of the topology's own admin calls (a superuser)
ADMIN_ROLE = "nemesis-admin"


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
        security: SecurityFiles | None = None,
        storage: str = "segment-files",
    ) -> None:
        self.root = root
        #: the bookies' ledger storage (``ledger_storage`` in [bookie])
        self.storage = storage
        self.metadata = metadata
        self.replication = replication
        self.hub = hub
        #: TOML tables merged into every node's configuration (e.g. the security keys of
        #: ``SecurityFiles.node_table()`` in [broker] and [bookie])
        self.config = config or {}
        #: secure mode (see the module doc): the run's CA, certificate and token key
        self.security = security
        self.server: ZooKeeperServer | EtcdServer | None = None
        self.nodes: dict[str, Node] = {}
        #: node name -> the proxy in front of it / its proxy to the metadata server
        self.inbound: dict[str, Proxy] = {}
        self.metadata_link: dict[str, Proxy] = {}
        self.http_ports: dict[str, int] = {}
        #: secure mode: broker name -> its native TLS port / its HTTPS admin port
        self.tls_ports: dict[str, int] = {}
        self.https_ports: dict[str, int] = {}
        #: broker name -> the proxy in front of its Kafka listener (which it advertises)
        self.kafka_inbound: dict[str, Proxy] = {}
        self._chroot = f"/n{uuid.uuid4().hex[:10]}"
        self._tls_context: ssl.SSLContext | None = None
        self._token: str | None = None

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
        if self.security is not None:
            self._admin(
                "POST",
                f"/admin/v2/namespaces/{NAMESPACE}/permissions/{APP_ROLE}",
                ["produce", "consume"],
            )
            self._check_app_role_is_not_admin()
        return self

    def _check_app_role_is_not_admin(self) -> None:
        """Secure mode: the workload's role is refused an admin call (403), so the run
        exercises authorization rather than a superuser's pass."""
        assert self.security is not None
        name = self.brokers[0]
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.https_ports[name]}/admin/v2/namespaces/{NAMESPACE}",
            data=b"{}",
            method="PUT",
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.security.token(APP_ROLE)}",
            },
        )
        try:
            urllib.request.urlopen(request, timeout=10, context=self._https_context()).close()
        except urllib.error.HTTPError as exc:
            if exc.code == 403:
                return
            raise AssertionError(f"{APP_ROLE} admin call: {exc.code}, expected 403") from None
        raise AssertionError(f"{APP_ROLE} may change namespace policies: it must not")

    def _node_config(self, kind: str) -> dict[str, dict[str, Any]]:
        """The security tables of a ``kind`` node in secure mode (nothing otherwise)."""
        if self.security is None:
            return {}
        table = self.security.node_table(role=NODE_ROLE, superuser_roles=(ADMIN_ROLE,))
        table["authorization_enabled"] = True
        return {kind: table}

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
        own = {"bookie": {"advertised_address": proxy.address, "ledger_storage": self.storage}}
        config.write_text(toml_text(merge_tables(own, self._node_config("bookie"), self.config)))
        args = bookie_args(
            self._metadata_url(name), port, self.root / name, "--config", str(config)
        )
        node = self.nodes[name] = Node("bookie", args, port, self.root / f"{name}.log")
        node.start()

    def _add_broker(self, name: str) -> None:
        port, http_port, kafka_port, tls_port, https_port = free_ports(5)
        secure = self._node_config("broker")
        if secure:
            # the proxy fronts the TLS port: clients speak pigeon+ssl:// through it
            self.tls_ports[name], self.https_ports[name] = tls_port, https_port
            secure["broker"] |= {
                "broker_service_port_tls": tls_port,
                "web_service_port_tls": https_port,
            }
        self.inbound[name] = self.hub.add(name, tls_port if secure else port)
        kafka = self.kafka_inbound[name] = self.hub.add(f"{name}-kafka", kafka_port)
        self.http_ports[name] = http_port
        own = self.root / f"{name}.toml"
        listener: dict[str, Any] = {
            "port": kafka_port,
            "namespace": NAMESPACE,
            "advertised_port": kafka.port,
            "group_initial_rebalance_delay_ms": 0,
        }
        if secure:
            listener["security_protocol"] = "SASL_SSL"
        own.write_text(
            toml_text(merge_tables(BROKER_CONFIG, {"kafka": listener}, secure, self.config))
        )
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
        scheme = "pigeon" if self.security is None else "pigeon+ssl"
        return f"{scheme}://" + ",".join(self.inbound[b].address for b in self.brokers)

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of the workload's ``Client``: in secure mode the run's CA
        and a token of :data:`APP_ROLE` (not a superuser)."""
        if self.security is None:
            return {}
        from pigeon.client import AuthenticationToken

        return {
            "authentication": AuthenticationToken(self.security.token(APP_ROLE)),
            "tls_trust_certs_file_path": str(self.security.ca_file),
        }

    def kafka_options(self) -> dict[str, Any]:
        """confluent-kafka settings of the Kafka workload: in secure mode SASL_SSL, the
        run's CA and SASL PLAIN with a token of :data:`APP_ROLE`."""
        if self.security is None:
            return {}
        return {
            "security.protocol": "SASL_SSL",
            "ssl.ca.location": str(self.security.ca_file),
            "sasl.mechanism": "PLAIN",
            "sasl.username": NAMESPACE,
            "sasl.password": f"token:{self.security.token(APP_ROLE)}",
        }

    @property
    def kafka_bootstrap(self) -> str:
        """The brokers' Kafka listeners' proxies (what the brokers advertise)."""
        return ",".join(self.kafka_inbound[b].address for b in self.brokers)

    @property
    def routes(self) -> dict[tuple[str, int], tuple[str, int]]:
        """Real broker address -> its proxy (see :func:`routed_lookups`)."""
        return {
            ("127.0.0.1", self.tls_ports.get(b, self.nodes[b].port)): (
                "127.0.0.1",
                self.inbound[b].port,
            )
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
        """One admin call on broker ``name``: HTTPS with a superuser token in secure
        mode, plain HTTP otherwise."""
        headers = {"Content-Type": "application/json"}
        context: ssl.SSLContext | None = None
        if self.security is None:
            url = f"http://127.0.0.1:{self.http_ports[name]}{path}"
        else:
            url = f"https://127.0.0.1:{self.https_ports[name]}{path}"
            context = self._https_context()
            headers["Authorization"] = f"Bearer {self._admin_token()}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            return json.loads(answer.read() or b"null")

    def _https_context(self) -> ssl.SSLContext:
        assert self.security is not None
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context(cafile=str(self.security.ca_file))
        return self._tls_context

    def _admin_token(self) -> str:
        assert self.security is not None
        if self._token is None:
            self._token = self.security.token(ADMIN_ROLE)
        return self._token

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
