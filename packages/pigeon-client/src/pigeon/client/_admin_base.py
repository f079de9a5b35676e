"""``pigeon admin``'s root command group, its settings and its output helpers.

The command modules use it as ``from pigeon.client import _admin_base as cli``: commands
that only show what one API call returns are added with :func:`show`, deletions with
:func:`delete`; the others are click functions printing through :func:`emit` and
:func:`done`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from pigeon.client import _units as units
from pigeon.client._admin_client import (
    DEFAULT_URL,
    AdminClient,
    AdminError,
    F,
    InvalidNamespace,
    check_admin_url,
)
from pigeon.client._cli_security import client_security, security_options
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    InvalidArgument,
    InvalidTopicName,
)

# ---------------------------------------------------------------------- output


@dataclass
class Settings:
    url: str
    json: bool
    timeout: float
    #: ``AdminClient`` keywords for credentials and TLS (:func:`client_security`)
    security: dict[str, Any] = field(default_factory=dict)

    def client(self) -> AdminClient:
        s = self.security
        return AdminClient(
            self.url,
            timeout=self.timeout,
            auth=s.get("authentication"),
            tls_trust_certs_file_path=s.get("tls_trust_certs_file_path"),
            tls_allow_insecure_connection=s.get("tls_allow_insecure_connection", False),
        )


def settings() -> Settings:
    ctx = click.get_current_context()
    settings = ctx.find_object(Settings)
    assert settings is not None
    return settings


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        settings = ctx.find_object(Settings)
        if settings is not None:
            settings.json = True


def json_flag(f: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Print the API's JSON.",
    )(f)


def fmt(value: Any, name: str = "") -> str:
    """``value`` as text; ``name`` (its JSON field) picks the unit (:func:`units.field`:
    ``*_s`` a duration, ``*_bytes`` a size, ...)."""
    return units.field(name, value)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[units.heading(c) for c in columns]]
    cells += [[fmt(r.get(c), c) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def kv(doc: dict[str, Any], skip: Iterable[str] = (), *, width: int = 0) -> str:
    """One ``key  value`` line per key (but ``skip``), the keys padded to one width."""
    keys = [k for k in doc if k not in set(skip)]
    width = max([width, *(len(k) for k in keys)])
    return "\n".join(f"{k.ljust(width)}  {fmt(doc[k], k)}" for k in keys)


def emit(result: Any, human: Callable[[Any], str] | None = None) -> None:
    if settings().json:
        click.echo(json.dumps(result, indent=2, sort_keys=False))
    elif human is not None:
        text = human(result)
        if text:
            click.echo(text)
    elif isinstance(result, list) and all(isinstance(x, str) for x in result):
        for x in result:
            click.echo(x)
    elif isinstance(result, dict):
        click.echo(kv(result))
    elif result is not None:
        click.echo(result)


def done(message: str, result: Any = None) -> None:
    """Confirm a change: the JSON result with --json, else a one-line message."""
    if settings().json:
        click.echo(json.dumps(result if result is not None else {"ok": True}, indent=2))
    else:
        click.echo(message)


def error_line(exc: AdminError) -> str:
    """The API's refusal in one line: ``error: TopicNotFound: topic ... (HTTP 404)``."""
    body = exc.body
    what = str(body.get("error") or "Error")
    message = " ".join(str(body.get("message") or body.get("detail") or "").split())
    status = f" (HTTP {exc.status})" if exc.status else ""
    return f"error: {what}: {message}{status}" if message else f"error: {what}{status}"


class AdminGroup(click.Group):
    """Turns AdminError into exit code 1 with one ``error: ...`` line on stderr (the
    API's JSON error, on one line, with ``--json``), and a 401/403
    (AuthenticationError, AuthorizationError) into exit code 1 with one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AdminError as exc:
            found = ctx.find_object(Settings)
            if found is not None and found.json:
                click.echo(json.dumps({"status": exc.status, **exc.body}), err=True)
            else:
                click.echo(error_line(exc), err=True)
            ctx.exit(1)
        except (AuthenticationError, AuthorizationError) as exc:  # the API refused: 401/403
            click.echo(f"error: {type(exc).__name__}: {exc.message}", err=True)
            ctx.exit(1)
        except (InvalidTopicName, InvalidNamespace) as exc:
            raise click.UsageError(str(exc), ctx) from None


def group(name: str, help_text: str) -> click.Group:
    """A subcommand group of ``pigeon admin`` (added by :mod:`pigeon.client._admin_cli`)."""
    return AdminGroup(name, help=help_text)


BUNDLE_COLUMNS = ["namespace", "bundle", "owner", "loaded_topics"]


def table_of(columns: Sequence[str]) -> Callable[[Iterable[dict[str, Any]]], str]:
    """A human form of a list of rows: a table of ``columns``."""
    return lambda rows: table(rows, columns)


def show(
    group: click.Group,
    name: str,
    help_text: str,
    fetch: Callable[..., Any],
    *arguments: str | click.Argument,
    human: Callable[[Any], str] | None = None,
) -> None:
    """Add ``group name ARGUMENTS... [--json]``: it prints what ``fetch(client, *values)``
    returns (``human(result)`` unless --json), ``values`` those of the arguments (a name
    or a click.Argument) in order."""
    params: list[click.Parameter] = [
        a if isinstance(a, click.Argument) else click.Argument([a]) for a in arguments
    ]

    def show(**values: Any) -> None:
        emit(fetch(settings().client(), *(values[p.name or ""] for p in params)), human)

    _add(group, name, help_text, params, show)


def delete(
    group: click.Group,
    help_text: str,
    call: Callable[..., Any],
    *arguments: str,
    force: str | None = None,
) -> None:
    """Add ``group delete ARGUMENTS... [--force] [--json]``: it calls ``call(client,
    *values)`` (with ``force=`` when ``force`` is the option's help) and confirms
    ``<last argument> <its value> deleted``."""
    params: list[click.Parameter] = [click.Argument([a]) for a in arguments]
    if force is not None:
        params.append(click.Option(["--force"], is_flag=True, help=force))

    def delete(**values: Any) -> None:
        flags = {"force": values["force"]} if force is not None else {}
        call(settings().client(), *(values[a] for a in arguments), **flags)
        done(f"{arguments[-1]} {values[arguments[-1]]} deleted")

    _add(group, "delete", help_text, params, delete)


def change(
    group: click.Group,
    name: str,
    help_text: str,
    call: Callable[..., Any],
    *arguments: str,
    confirm: str,
) -> None:
    """Add ``group name ARGUMENTS... [--json]``: it calls ``call(client, *values)`` and
    confirms with ``confirm`` formatted with the result's keys and the arguments' values
    (``"compaction of {topic}: {status}"``), or prints the result with --json."""
    params: list[click.Parameter] = [click.Argument([a]) for a in arguments]

    def change(**values: Any) -> None:
        result = call(settings().client(), *(values[a] for a in arguments))
        done(confirm.format_map({**(result or {}), **values}), result)

    _add(group, name, help_text, params, change)


def _add(
    group: click.Group,
    name: str,
    help_text: str,
    params: list[click.Parameter],
    callback: Callable[..., None],
) -> None:
    command = click.Command(name, callback=callback, params=list(params), help=help_text)
    group.add_command(json_flag(command))


# ---------------------------------------------------------------------- commands


@click.group("admin", cls=AdminGroup)
@click.option(
    "--url",
    default=DEFAULT_URL,
    show_default=True,
    envvar="PIGEON_ADMIN_URL",
    help="The broker's HTTP (admin) address (https://host:port for TLS).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of tables.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds per HTTP request.")
@security_options
@click.pass_context
def admin_cmd(
    ctx: click.Context, /, url: str, as_json: bool, timeout: float, **security: Any
) -> None:
    """Inspect and change a PigeonMQ cluster through a broker's admin API."""
    try:
        check_admin_url(url)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="'--url'") from None
    ctx.obj = Settings(url, as_json, timeout, client_security(security))
