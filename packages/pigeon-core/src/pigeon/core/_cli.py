"""The ``pigeon`` command: one click group; packages add subcommands via a hook."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from pigeon.core._plugins import PluginManager
from pigeon.core.errors import PigeonError

__all__ = ["error_line", "main", "make_cli", "setup_logging"]


#: commands that run a server: they log at INFO by default, the others at WARNING
SERVER_COMMANDS = frozenset({"standalone", "broker", "bookie"})


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = (
            f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} level={record.levelname} "
            f"logger={record.name} msg={record.getMessage()!r}"
        )
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup_logging(level: str = "INFO") -> Callable[[], None]:
    """Send every log record to stderr as one ``key=value`` line from ``level`` up; return
    the function that puts the root logger back as it was."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    root = logging.getLogger()
    handlers, old_level = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

    def restore() -> None:
        root.handlers[:] = handlers
        root.setLevel(old_level)

    return restore


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def error_line(exc: BaseException) -> str:
    """The one line a user sees for ``exc`` (without ``--debug``): ``error: Type: text``
    for a PigeonError, the OS's words for an OSError (a file that cannot be read), and
    for anything else (a bug) its type with a pointer to ``--debug``."""
    if isinstance(exc, PigeonError):
        return f"error: {type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        return f"error: {exc}"
    return (
        f"error: unexpected {type(exc).__name__}: {exc} (a bug: run again with --debug"
        " for the traceback, and please report it)"
    )


class _UsageError(click.UsageError):
    """click's usage error as one line and the hint to ``--help`` (click prints four:
    the usage, the hint, a blank line and the error)."""

    def show(self, file: Any = None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {self.format_message()}{hint}", err=True)


def _one_line_usage(exc: click.UsageError) -> _UsageError:
    return _UsageError(exc.format_message(), exc.ctx)  # exit status 2, as click's


class _Group(click.Group):
    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _UsageError:
            raise
        except click.UsageError as exc:
            raise _one_line_usage(exc) from exc

    def invoke(self, ctx: click.Context) -> object:
        """Any error (also those tasks raised inside a nursery: an exception group) is one
        line per distinct error on stderr and exit status 2 for a PigeonError, 1 for
        anything else, not a traceback; ``--debug`` prints the traceback first."""
        try:
            return super().invoke(ctx)
        except _UsageError:
            raise
        except click.UsageError as exc:
            raise _one_line_usage(exc) from exc
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (Exception, BaseExceptionGroup) as exc:
            errors = _leaves(exc)
            if not all(isinstance(e, Exception) for e in errors):
                raise  # KeyboardInterrupt inside a group: click's "Aborted!"
            if ctx.params.get("debug"):
                traceback.print_exception(exc, file=sys.stderr)
            for line in dict.fromkeys(error_line(e) for e in errors):
                click.echo(line, err=True)
            sys.exit(2 if all(isinstance(e, PigeonError) for e in errors) else 1)


def _print_versions(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: one line per installed PigeonMQ distribution, ``NAME VERSION``."""
    if not value or ctx.resilient_parsing:
        return
    from pigeon.core._versions import installed_distributions

    for name, version in installed_distributions():
        click.echo(f"{name} {version}")
    ctx.exit(0)


def make_cli(plugins: PluginManager | None = None) -> click.Group:
    pm = plugins or PluginManager()

    @click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
    @click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_print_versions,
        help="Print each installed PigeonMQ distribution and its version, and exit.",
    )
    @click.option(
        "--log-level",
        default=None,
        envvar="PIGEON_LOG_LEVEL",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        help="Default: INFO for the servers (standalone, broker, bookie), WARNING for the"
        " other commands (a client's reconnect attempts are not news on a terminal).",
    )
    @click.option(
        "--debug",
        is_flag=True,
        envvar="PIGEON_DEBUG",
        help="On an error, print its traceback before the one-line message.",
    )
    @click.pass_context
    def cli(ctx: click.Context, log_level: str | None, debug: bool) -> None:
        """PigeonMQ: distributed messaging and streaming."""
        if log_level is None:
            log_level = "INFO" if ctx.invoked_subcommand in SERVER_COMMANDS else "WARNING"
        # the root logger is the command's while it runs, the caller's again after
        ctx.call_on_close(setup_logging(log_level))
        ctx.obj = pm

    @cli.command("plugins")
    def plugins_cmd() -> None:
        """List loaded plugins and what they registered."""
        click.echo("plugins: " + ", ".join(pm.plugin_names()))
        click.echo("metadata stores: " + ", ".join(pm.metadata_stores))
        click.echo("replication policies: " + ", ".join(pm.replication_policies))
        click.echo("codecs: " + ", ".join(pm.codecs))
        click.echo("authentication providers: " + ", ".join(pm.authentication_providers))
        click.echo("ledger storages: " + (", ".join(pm.ledger_storages) or "(none)"))
        click.echo("offloaders: " + (", ".join(pm.offloaders) or "(none)"))

    pm.pm.hook.pigeon_cli_commands(group=cli)
    return cli


def main() -> None:
    try:
        cli = make_cli()
    except PigeonError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    cli()
