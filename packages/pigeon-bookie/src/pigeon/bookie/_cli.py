"""``pigeon bookie`` (run a bookie) and ``pigeon bookie inspect DATA_DIR``."""

from __future__ import annotations

import functools
import json
from typing import Any

import click
import pluggy
import trio

from pigeon.bookie._inspect import DataDirLocked, format_table, inspect_data_dir
from pigeon.bookie._service import BookieConfig, BookieServer
from pigeon.core import PluginManager, Registry, load_config
from pigeon.core.errors import StorageError

hookimpl = pluggy.HookimplMarker("pigeon")

#: ``pigeon bookie inspect`` exit codes
EXIT_OK, EXIT_CORRUPT, EXIT_CANNOT_INSPECT = 0, 1, 2


@click.group("bookie", invoke_without_command=True)
@click.option(
    "--metadata",
    help="Metadata store URL: zk://host:2181/chroot, etcd://host:2379/prefix, embedded:///dir",
)
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Bookie port (default 3181).")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Where segments live.")
@click.option(
    "--fsync",
    type=click.Choice(["always", "interval", "never"]),
    help="fsync policy (default always).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML configuration file ([bookie] table).",
)
@click.option("--http-port", type=int, help="Serve Prometheus GET /metrics on this port.")
@click.option(
    "--storage",
    metavar="NAME",
    help="Ledger storage backend (default segment-files; `pigeon plugins` lists them).",
)
@click.pass_context
def bookie_cmd(
    ctx: click.Context,
    metadata: str | None,
    host: str | None,
    port: int | None,
    data_dir: str | None,
    fsync: str | None,
    config_file: str | None,
    http_port: int | None,
    storage: str | None,
) -> None:
    """Run a bookie (storage node) registered in the metadata store."""
    if ctx.invoked_subcommand is not None:
        return
    plugins: PluginManager = ctx.obj
    config = load_config(
        BookieConfig,
        path=config_file,
        section="bookie",
        overrides={
            "metadata": metadata,
            "host": host,
            "port": port,
            "data_dir": data_dir,
            "fsync": fsync,
            "http_port": http_port,
            "ledger_storage": storage,
        },
    )
    if not config.metadata:
        raise click.UsageError(
            "--metadata (or PIGEON_METADATA, or metadata in [bookie]) is required"
        )
    from pigeon.core.runtime import open_metadata_store, run_until_signal

    store = open_metadata_store(config.metadata, plugins)
    # TLS files and authentication providers load now: a bad one is one line, no start
    server = BookieServer(config, metadata=store, plugins=plugins)

    async def main(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            await nursery.start(server.run)
            task_status.started(server)

    trio.run(
        functools.partial(
            run_until_signal,
            main,
            ready=lambda s: click.echo(f"bookie ready on {s.advertised}", err=True),
        )
    )


@bookie_cmd.command("inspect")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--segment",
    "segment",
    help="Only this segment (id in decimal, or 16 hex digits).",
)
def inspect_cmd(data_dir: str, as_json: bool, segment: str | None) -> None:
    """Check every segment of a stopped bookie's DATA_DIR.

    Lists the segments (entries, first/last entry id, lac, fenced, size) and verifies
    every checksum without changing anything.  Exit code: 0 healthy (a torn tail left
    by a crash is reported, not counted), 1 corruption found, 2 the directory cannot be
    inspected (in use by a running bookie, or not a bookie data directory).
    """
    segment_id: int | None = None
    if segment is not None:
        try:
            segment_id = int(segment, 16) if len(segment) == 16 else int(segment)
        except ValueError:
            raise click.BadParameter(f"not a segment id: {segment!r}") from None
    try:
        report = inspect_data_dir(data_dir, segment=segment_id)
    except DataDirLocked as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(EXIT_CANNOT_INSPECT) from None
    except (StorageError, OSError) as exc:
        click.echo(f"error: cannot inspect {data_dir}: {exc}", err=True)
        raise SystemExit(EXIT_CANNOT_INSPECT) from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(format_table(report))
    raise SystemExit(EXIT_CORRUPT if report.corrupt else EXIT_OK)


@hookimpl
def pigeon_cli_commands(group: click.Group) -> None:
    group.add_command(bookie_cmd)


@hookimpl
def pigeon_ledger_storages(registry: Registry[Any]) -> None:
    from pigeon.bookie._journal import JournalStore
    from pigeon.bookie._storage import SegmentStore

    def segment_files(config: BookieConfig) -> SegmentStore:
        return SegmentStore(
            config.data_dir,
            fsync=config.fsync,
            fsync_interval_ms=config.fsync_interval_ms,
            verify_tail_bytes=config.verify_tail_bytes,
            page_cache_window_bytes=config.page_cache_window_bytes,
        )

    registry.register("segment-files", segment_files)

    def journal(config: BookieConfig) -> JournalStore:
        journal_directory, ledger_directories = config.journal_paths()
        return JournalStore(
            journal_directory,
            ledger_directories,
            fsync=config.fsync,
            fsync_interval_ms=config.fsync_interval_ms,
            journal_max_group_wait_ms=config.journal_max_group_wait_ms,
            journal_inline_sync_max_bytes=config.journal_inline_sync_max_bytes,
            journal_inline_sync_max_ms=config.journal_inline_sync_max_ms,
            journal_max_size_mb=config.journal_max_size_mb,
            journal_pre_alloc_size_mb=config.journal_pre_alloc_size_mb,
            entry_log_size_limit=config.entry_log_size_limit,
            flush_interval_ms=config.flush_interval_ms,
            flush_entrylog_bytes=config.flush_entrylog_bytes,
            journal_remove_pages_from_cache=config.journal_remove_pages_from_cache,
            page_cache_window_bytes=config.page_cache_window_bytes,
            minor_compaction_threshold=config.minor_compaction_threshold,
            minor_compaction_interval_s=config.minor_compaction_interval_s,
            major_compaction_threshold=config.major_compaction_threshold,
            major_compaction_interval_s=config.major_compaction_interval_s,
            format_root=config.data_dir,
        )

    registry.register("journal", journal)
