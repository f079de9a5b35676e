"""``pigeon broker`` and ``pigeon standalone``."""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import tomllib
from pathlib import Path
from typing import Any

import click
import pluggy
import trio

from pigeon.broker._config import BrokerConfig, KafkaConfig
from pigeon.core import PluginManager, load_config
from pigeon.core.errors import ConfigError, DataDirLocked

hookimpl = pluggy.HookimplMarker("pigeon")


def _broker_config(
    config_file: str | None, *, kafka_port: int | None, kafka_default: int, **flags: Any
) -> BrokerConfig:
    """``[broker]`` and ``[kafka]`` from the file, the environment and the flags; the
    Kafka port is ``kafka_default`` unless one of those sets it."""
    config = load_config(BrokerConfig, path=config_file, section="broker", overrides=flags)
    env_port = os.environ.get("PIGEON_KAFKA_PORT")
    port = kafka_port if kafka_port is not None else env_port
    config.kafka = load_config(
        KafkaConfig, path=config_file, section="kafka", env={}, overrides={"port": port}
    )
    if port is None and not _sets(config_file, "kafka", "port"):
        config.kafka.port = kafka_default
    return config


def _sets(config_file: str | None, section: str, key: str) -> bool:
    """Whether the TOML file's ``[section]`` sets ``key`` (it was read once already)."""
    if config_file is None:
        return False
    table = tomllib.loads(Path(config_file).read_text()).get(section, {})
    return isinstance(table, dict) and key in table


def _kafka_note(service: Any) -> str:
    """``, pigeon+ssl://host:port`` when the broker serves TLS, ``, Kafka clients on
    host:port (SASL_SSL)`` when it serves the Kafka protocol."""
    note = ""
    tls = getattr(service, "service_url_tls", None)
    if tls:
        note += f", {tls}"
    kafka = getattr(service, "kafka", None)
    if kafka is not None:
        protocol = service.config.kafka.security_protocol
        extra = f" ({protocol})" if protocol != "PLAINTEXT" else ""
        note += f", Kafka clients on {kafka.advertised_address}{extra}"
    return note


def _check_ports(ports: list[tuple[str, str, int]]) -> None:
    """Before anything starts: a port another process listens on is one ConfigError
    naming the port and the flag that sets it (``(flag, host, port)``; ports below 1,
    ephemeral or off, are not checked).  It connects rather than binds: a port held only
    as the local end of some connection (an ephemeral port) is no server of ours to name,
    and what the listeners' own bind says of it is left to them."""
    for flag, host, port in ports:
        if port <= 0:
            continue
        target = host if host and host not in ("0.0.0.0", "::") else "127.0.0.1"
        try:
            with socket.create_connection((target, port), timeout=0.5):
                pass
        except OSError:
            continue  # refused, unreachable or silent: no listener to name
        raise ConfigError(
            f"port {port} is already in use ({flag}): stop what holds it"
            f" (another pigeon standalone?) or pass another {flag}"
        )


def _lock_data_dir(data_dir: Path) -> int:
    """Hold ``data_dir/LOCK`` (flock, released when the process ends) and write our pid in
    it; a second standalone on the same directory gets one DataDirLocked line naming the
    holder before it opens anything."""
    path = data_dir / "LOCK"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"pigeon standalone pid {holder}" if holder.isdigit() else "another process"
        raise DataDirLocked(
            f"data directory {data_dir} is in use by {who}: stop it, or pass another --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


_KAFKA_PORT_HELP = "Kafka protocol port ({}; -1: off; [kafka] port, PIGEON_KAFKA_PORT)."


@click.command("broker")
@click.option(
    "--metadata",
    help="Metadata store URL: zk://host:2181/chroot, etcd://host:2379/prefix, embedded:///dir",
)
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Client port (default 6650).")
@click.option(
    "--http-port", type=int, help="Admin API, /metrics and /dashboard port (default 8080; -1: off)."
)
@click.option("--kafka-port", type=int, help=_KAFKA_PORT_HELP.format("default: off"))
@click.option(
    "--replication",
    help="Replication policy of new segments: quorum (default) or leader-follower (plugin).",
)
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file."
)
@click.pass_obj
def broker_cmd(
    plugins: PluginManager,
    metadata: str | None,
    host: str | None,
    port: int | None,
    http_port: int | None,
    kafka_port: int | None,
    replication: str | None,
    config_file: str | None,
) -> None:
    """Run a broker that stores on the bookies registered in the metadata store."""
    from pigeon.broker._node import run_broker, run_layered
    from pigeon.core.runtime import open_metadata_store, run_until_signal

    config = _broker_config(
        config_file,
        metadata=metadata,
        host=host,
        port=port,
        http_port=http_port,
        replication=replication,
        kafka_port=kafka_port,
        kafka_default=-1,
    )
    if not config.metadata:
        raise click.UsageError(
            "--metadata (or PIGEON_METADATA, or metadata in [broker]) is required"
        )
    _check_ports(
        [
            ("--port", config.host, config.port),
            ("--http-port", config.host, config.http_port),
            ("--kafka-port", config.kafka.host or config.host, config.kafka.port),
        ]
    )
    store = open_metadata_store(config.metadata, plugins)

    async def main(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async def infrastructure(nursery: trio.Nursery) -> None:
            await nursery.start(store.run)

        async def broker(task_status: Any) -> None:
            await run_broker(config, store=store, plugins=plugins, task_status=task_status)

        await run_layered(infrastructure, broker, task_status.started)

    trio.run(
        functools.partial(
            run_until_signal,
            main,
            ready=lambda s: click.echo(
                f"broker ready on {s.service_url}{_kafka_note(s)}", err=True
            ),
        )
    )


@click.command("standalone")
@click.option(
    "--data-dir", default="./pigeon-data", show_default=True, type=click.Path(file_okay=False)
)
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Broker port (default 6650).")
@click.option("--bookie-port", type=int, help="Bookie port (default 3181).")
@click.option(
    "--http-port", type=int, help="Admin API, /metrics and /dashboard port (default 8080; -1: off)."
)
@click.option("--kafka-port", type=int, help=_KAFKA_PORT_HELP.format("default 9092"))
@click.option(
    "--fsync",
    type=click.Choice(["always", "interval", "never"]),
    help="Bookie fsync policy (default always).",
)
@click.option(
    "--storage",
    metavar="NAME",
    help="Bookie ledger storage backend (default segment-files; `pigeon plugins` lists them).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML configuration file ([broker] and [bookie] tables).",
)
@click.pass_obj
def standalone_cmd(
    plugins: PluginManager,
    data_dir: str,
    host: str | None,
    port: int | None,
    bookie_port: int | None,
    http_port: int | None,
    kafka_port: int | None,
    fsync: str | None,
    storage: str | None,
    config_file: str | None,
) -> None:
    """Run broker + bookie + embedded metadata in one process."""
    from pigeon.bookie import BookieConfig
    from pigeon.broker._node import run_standalone
    from pigeon.core.runtime import run_until_signal

    broker_config = _broker_config(
        config_file,
        host=host,
        port=port,
        http_port=http_port,
        kafka_port=kafka_port,
        kafka_default=9092,
    )
    bookie_config = load_config(
        BookieConfig,
        path=config_file,
        section="bookie",
        env={},
        overrides={
            "host": host,
            "port": bookie_port,
            "fsync": fsync,
            "ledger_storage": storage,
        },
    )
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    _lock_data_dir(Path(data_dir))  # held until the process ends
    _check_ports(
        [
            ("--port", broker_config.host, broker_config.port),
            ("--bookie-port", bookie_config.host, bookie_config.port),
            ("--http-port", broker_config.host, broker_config.http_port),
            (
                "--kafka-port",
                broker_config.kafka.host or broker_config.host,
                broker_config.kafka.port,
            ),
        ]
    )

    def ready(service: Any) -> None:
        click.echo(
            f"pigeon standalone ready on {service.service_url}{_kafka_note(service)}"
            f" (data in {data_dir})",
            err=True,
        )

    trio.run(
        functools.partial(
            run_until_signal,
            lambda task_status: run_standalone(
                data_dir, broker_config, bookie_config, plugins=plugins, task_status=task_status
            ),
            ready=ready,
        )
    )


@hookimpl
def pigeon_offloaders(registry: Any) -> None:
    from pigeon.broker._offload import make_filesystem, make_s3

    registry.register("filesystem", make_filesystem)
    registry.register("s3", make_s3)


@hookimpl
def pigeon_cli_commands(group: click.Group) -> None:
    from pigeon.broker._tokens_cli import tokens_cmd

    group.add_command(broker_cmd)
    group.add_command(standalone_cmd)
    group.add_command(tokens_cmd)
