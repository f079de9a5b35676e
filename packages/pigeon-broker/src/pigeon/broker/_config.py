"""Broker configuration (TOML ``[broker]``, ``PIGEON_*`` environment, flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pigeon.core.config import SecurityConfig
from pigeon.core.errors import ConfigError
from pigeon.core.rpc import DEFAULT_MAX_FRAME_SIZE

__all__ = ["BrokerConfig", "KafkaConfig"]


@dataclass
class KafkaConfig:
    """The Kafka front door (TOML ``[kafka]``; ``--kafka-port``)."""

    #: the Kafka listener's port; -1: no Kafka listener (``pigeon standalone``: 9092)
    port: int = -1
    #: address to listen on (default: the broker's ``host``)
    host: str = ""
    #: host name Kafka clients are told to connect to (default: the listening address)
    advertised_host: str = ""
    #: port Kafka clients are told to connect to (0: the listening port), for a proxy or
    #: a port mapping in between
    advertised_port: int = 0
    #: the namespace Kafka topics live in
    namespace: str = "public/default"
    #: partitions of a topic created by a produce, fetch or metadata request
    default_partitions: int = 1
    #: create unknown topics when a client asks for them (Kafka's
    #: ``auto.create.topics.enable``)
    auto_create_topics: bool = True
    #: a new consumer group waits this long for more members before its first
    #: assignment (Kafka's ``group.initial.rebalance.delay.ms``)
    group_initial_rebalance_delay_ms: int = 3000
    #: the listener's security protocol (Kafka's listener security protocols):
    #: ``PLAINTEXT``, ``SSL`` (the broker's ``tls_*`` certificate; with
    #: ``tls_require_trusted_client_cert`` the client certificate's common name is the
    #: role), ``SASL_PLAINTEXT`` or ``SASL_SSL`` (a token through SASL PLAIN or
    #: OAUTHBEARER; needs ``authentication_enabled`` with the ``token`` provider)
    security_protocol: str = "PLAINTEXT"
    #: SASL mechanisms offered (Kafka's ``sasl.enabled.mechanisms``): PLAIN, OAUTHBEARER
    sasl_enabled_mechanisms: list[str] = field(default_factory=lambda: ["PLAIN", "OAUTHBEARER"])

    @property
    def tls(self) -> bool:
        """Does the listener speak TLS (``SSL`` or ``SASL_SSL``)?"""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        """Do clients authenticate with SASL (``SASL_PLAINTEXT`` or ``SASL_SSL``)?"""
        return self.security_protocol.startswith("SASL_")

    def validate_security(self, broker: SecurityConfig) -> None:
        """The checks that need the broker's security settings too.

        :raises ConfigError: TLS asked without the broker's certificate, SASL without
            token authentication.
        """
        if self.tls and not broker.tls_certificate_file:
            raise ConfigError(
                f"[kafka] security_protocol = {self.security_protocol!r} needs the broker's"
                " certificate: set 'tls_certificate_file' and 'tls_key_file'"
            )
        if self.sasl and not (
            broker.authentication_enabled and "token" in broker.authentication_providers
        ):
            raise ConfigError(
                f"[kafka] security_protocol = {self.security_protocol!r} checks tokens: set"
                " 'authentication_enabled = true' with the 'token' authentication provider"
            )

    def validate(self) -> None:
        if not -1 <= self.port < 65536:
            raise ConfigError(
                f"bad value for 'port' in [kafka]: {self.port} is not a TCP port or -1"
            )
        tenant, _, ns = self.namespace.partition("/")
        if not tenant or not ns or "/" in ns:
            raise ConfigError(
                f"bad value for 'namespace' in [kafka]: {self.namespace!r} is not tenant/namespace"
            )
        if not 1 <= self.default_partitions <= 4096:
            raise ConfigError("bad value for 'default_partitions' in [kafka]: must be 1..4096")
        if self.group_initial_rebalance_delay_ms < 0:
            raise ConfigError(
                "bad value for 'group_initial_rebalance_delay_ms' in [kafka]: must be >= 0"
            )
        protocols = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
        self.security_protocol = str(self.security_protocol).strip().upper()
        if self.security_protocol not in protocols:
            raise ConfigError(
                f"bad value for 'security_protocol' in [kafka]: {self.security_protocol!r}"
                f" (one of {', '.join(protocols)})"
            )
        from pigeon.broker._kafka_sasl import check_mechanisms

        self.sasl_enabled_mechanisms = list(check_mechanisms(self.sasl_enabled_mechanisms))


@dataclass
class BrokerConfig(SecurityConfig):
    """A broker's settings; the TLS, authentication and authorization keys come from
    :class:`pigeon.core.config.SecurityConfig` (docs/security.md)."""

    host: str = "127.0.0.1"
    port: int = 6650
    http_port: int = 8080  # admin API, /metrics and /dashboard; -1: not served
    #: the native protocol over TLS (Pulsar's brokerServicePortTls, e.g. 6651); -1: none
    broker_service_port_tls: int = -1
    #: the admin API, /metrics and /dashboard over HTTPS (webServicePortTls, e.g. 8443)
    web_service_port_tls: int = -1
    #: with authentication on, /metrics needs a token too (a Prometheus scraper sends
    #: one as its bearer token); false: /metrics stays open (counters only, no secrets)
    authenticate_metrics_endpoint: bool = True
    metadata: str = ""
    cluster_name: str = "standalone"
    max_message_size: int = 5 * 1024 * 1024
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    segment_max_entries: int = 50_000
    segment_max_bytes: int = 512 * 1024 * 1024
    segment_max_age_s: float = 4 * 3600.0
    cache_max_bytes: int = 256 * 1024 * 1024
    cursor_persist_interval_ms: float = 100.0
    maintenance_interval_s: float = 5.0
    bundles_per_namespace: int = 4
    #: a bookie missing this long has its data re-replicated by the elected auditor
    auditor_grace_period_s: float = 30.0
    auditor_interval_s: float = 5.0
    #: how often the elected load manager compares broker loads and sheds bundles
    load_manager_interval_s: float = 10.0
    #: shed only from a broker serving more topics than the cluster mean + this percentage
    load_balancer_broker_overloaded_threshold_percentage: float = 20.0
    #: bundles with less inbound traffic (MB/s) are never moved; 0: any bundle may move
    load_balancer_bundle_unload_minimum_throughput_threshold: float = 0.0
    #: a bundle that moved is not moved again for this long
    load_balancer_shedding_grace_period_minutes: float = 30.0
    replication: str = "quorum"
    ensemble_size: int = 1
    write_quorum: int = 1
    ack_quorum: int = 1
    #: at an entry no replica holds intact: "skip" past it (its messages count as lost)
    #: or "fail" (delivery stops there); namespaces may override it
    corrupt_entry_policy: Literal["skip", "fail"] = "skip"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # -- tiered storage (Pulsar's managedLedgerOffload* and offloader keys)
    #: the offloader closed segments are copied to: "" (off), "filesystem", "s3" (or a
    #: plugin's); namespaces choose when (``offload_threshold_bytes``)
    managed_ledger_offload_driver: str = ""
    #: ``filesystem``: the file system, ``file:///mnt/nfs`` (a mounted NFS/HDFS path)
    file_system_uri: str = ""
    #: ``filesystem``: the directory (under ``file_system_uri``) holding offloaded segments
    offload_directory: str = ""
    #: ``s3``: the bucket (credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)
    s3_managed_ledger_offload_bucket: str = ""
    #: ``s3``: the bucket's region
    s3_managed_ledger_offload_region: str = ""
    #: ``s3``: the endpoint of an S3-compatible store (``http://127.0.0.1:9000``);
    #: "" for AWS itself
    s3_managed_ledger_offload_service_endpoint: str = ""
    #: how often the elected sweeper looks for offloaded objects no ledger refers to
    #: (left by a crash, see docs/operations.md); 0: never
    managed_ledger_offload_sweep_interval_s: float = 3600.0
    #: an unreferenced object is deleted only once it is this old (an upload being
    #: recorded, or a metadata read that lags, is never mistaken for an orphan)
    managed_ledger_offload_orphan_grace_s: float = 6 * 3600.0
    #: objects one sweep pass lists at most (the next pass goes on from there)
    managed_ledger_offload_sweep_max_objects: int = 1000
    #: the ``[kafka]`` table (loaded on its own: see pigeon.broker._cli)
    kafka: KafkaConfig = field(default_factory=KafkaConfig, init=False)

    def quorum(self) -> dict[str, int]:
        """``ensemble_size``, ``write_quorum`` and ``ack_quorum``: the keywords a
        replication policy factory takes them as."""
        return {k: getattr(self, k) for k in ("ensemble_size", "write_quorum", "ack_quorum")}

    def offloader(self, registry: Any) -> Any:
        """The :class:`pigeon.core.offload.Offloader` that
        ``managed_ledger_offload_driver`` names (built by its factory), or None."""
        driver = self.managed_ledger_offload_driver.strip()
        if not driver:
            return None
        if driver not in registry:
            raise ConfigError(
                f"bad value for 'managed_ledger_offload_driver': {driver!r} (known:"
                f" {', '.join(registry) or 'none'})"
            )
        return registry.get(driver)(self)

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"bad value for 'port': {self.port} is not a TCP port")
        for key in ("broker_service_port_tls", "web_service_port_tls"):
            value = getattr(self, key)
            if not -1 <= value < 65536:
                raise ConfigError(f"bad value for {key!r}: {value} is not a TCP port or -1")
            if value >= 0 and not self.tls_certificate_file:
                raise ConfigError(
                    f"{key!r} needs 'tls_certificate_file' and 'tls_key_file' (the broker's"
                    " certificate)"
                )
        self.validate_security()
        if not -1 <= self.http_port < 65536:
            raise ConfigError(
                f"bad value for 'http_port': {self.http_port} is not a TCP port or -1"
            )
        if self.max_message_size <= 0:
            raise ConfigError("bad value for 'max_message_size': must be positive")
        if self.max_frame_size < self.max_message_size + 1024:
            raise ConfigError(
                "bad value for 'max_frame_size': must exceed max_message_size by at least 1024"
            )
        if self.segment_max_entries <= 0:
            raise ConfigError("bad value for 'segment_max_entries': must be positive")
        for key in (
            "load_balancer_broker_overloaded_threshold_percentage",
            "load_balancer_bundle_unload_minimum_throughput_threshold",
            "load_balancer_shedding_grace_period_minutes",
            "managed_ledger_offload_sweep_interval_s",
            "managed_ledger_offload_orphan_grace_s",
        ):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ConfigError(f"bad value for {key!r}: {value!r} is not a number >= 0")
        max_objects = self.managed_ledger_offload_sweep_max_objects
        if not (isinstance(max_objects, int) and max_objects > 0):
            raise ConfigError(
                "bad value for 'managed_ledger_offload_sweep_max_objects':"
                f" {max_objects!r} is not a positive integer"
            )
        if self.corrupt_entry_policy not in ("skip", "fail"):
            raise ConfigError(
                f"bad value for 'corrupt_entry_policy': {self.corrupt_entry_policy!r} is not"
                " 'skip' or 'fail'"
            )
        if not self.ensemble_size >= self.write_quorum >= self.ack_quorum >= 1:
            raise ConfigError(
                "bad values for 'ensemble_size', 'write_quorum', 'ack_quorum': need "
                "ensemble_size >= write_quorum >= ack_quorum >= 1"
            )
