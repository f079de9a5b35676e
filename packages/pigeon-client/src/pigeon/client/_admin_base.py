"""``pigeon admin``'s root command group, its settings and its output helpers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import click

from pigeon.client._admin_client import (
    DEFAULT_URL,
    AdminClient,
    AdminError,
    F,
    InvalidNamespace,
)
from pigeon.core.errors import InvalidTopicName

# ---------------------------------------------------------------------- output


@dataclass
class _Settings:
    url: str
    json: bool
    timeout: float

    def client(self) -> AdminClient:
        return AdminClient(self.url, timeout=self.timeout)


def _settings() -> _Settings:
    ctx = click.get_current_context()
    settings = ctx.find_object(_Settings)
    assert settings is not None
    return settings


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        settings = ctx.find_object(_Settings)
        if settings is not None:
            settings.json = True


def _json_flag(f: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Print the API's JSON.",
    )(f)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1e15 else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[c.upper() for c in columns]]
    cells += [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _kv(doc: dict[str, Any], skip: Iterable[str] = ()) -> str:
    keys = [k for k in doc if k not in set(skip)]
    width = max((len(k) for k in keys), default=0)
    return "\n".join(f"{k.ljust(width)}  {_fmt(doc[k])}" for k in keys)


def _emit(result: Any, human: Callable[[Any], str] | None = None) -> None:
    if _settings().json:
        click.echo(json.dumps(result, indent=2, sort_keys=False))
    elif human is not None:
        text = human(result)
        if text:
            click.echo(text)
    elif isinstance(result, list) and all(isinstance(x, str) for x in result):
        for x in result:
            click.echo(x)
    elif isinstance(result, dict):
        click.echo(_kv(result))
    elif result is not None:
        click.echo(result)


def _done(message: str, result: Any = None) -> None:
    """Confirm a change: the JSON result with --json, else a one-line message."""
    if _settings().json:
        click.echo(json.dumps(result if result is not None else {"ok": True}, indent=2))
    else:
        click.echo(message)


class _AdminGroup(click.Group):
    """Turns AdminError into exit code 1 with the JSON error on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AdminError as exc:
            click.echo(json.dumps({"status": exc.status, **exc.body}), err=True)
            ctx.exit(1)
        except (InvalidTopicName, InvalidNamespace) as exc:
            raise click.UsageError(str(exc), ctx) from None


def _group(name: str, help_text: str) -> Callable[[F], click.Group]:
    def wrap(f: F) -> click.Group:
        return click.group(name, cls=_AdminGroup, help=help_text)(f)

    return wrap


# ---------------------------------------------------------------------- commands


@click.group("admin", cls=_AdminGroup)
@click.option(
    "--url",
    default=DEFAULT_URL,
    show_default=True,
    envvar="PIGEON_ADMIN_URL",
    help="The broker's HTTP (admin) address.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of tables.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds per HTTP request.")
@click.pass_context
def admin_cmd(ctx: click.Context, url: str, as_json: bool, timeout: float) -> None:
    """Inspect and change a PigeonMQ cluster through a broker's admin API."""
    ctx.obj = _Settings(url, as_json, timeout)
