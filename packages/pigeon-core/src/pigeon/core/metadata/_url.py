"""URLs of metadata servers: ``scheme://host[:port][,host[:port]...]/path?option=seconds``.

The ZooKeeper and etcd backends are configured the same way (``zk://zk1,zk2/pigeon``,
``etcd://10.0.0.1:2379/pigeon?session_timeout=5``): one or more ``host[:port]``, a path
under which the store keeps everything, and options in seconds.  Every mistake is a
:class:`~pigeon.core.errors.ConfigError` naming the URL.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

from pigeon.core.errors import ConfigError, InvalidArgument
from pigeon.core.metadata._store import validate_path

__all__ = ["ServerURL", "parse_server_url"]

T = TypeVar("T")


@dataclass(frozen=True)
class ServerURL:
    #: ``host:port`` of each server, in the URL's order
    hosts: tuple[str, ...]
    #: the URL's path (a valid node path), or the default
    path: str
    #: option → seconds
    options: dict[str, float]
    #: the URL itself, for messages
    url: str = field(default="", compare=False)

    def build(self, store: Callable[..., T], *args: object) -> T:
        """``store(*args, path, **options)``: a bad value (``InvalidArgument``) is a
        :class:`~pigeon.core.errors.ConfigError` naming the URL."""
        try:
            return store(*args, self.path, **self.options)
        except InvalidArgument as exc:
            raise ConfigError(f"metadata URL {self.url!r}: {exc}") from None


def parse_server_url(
    url: str,
    *,
    scheme: str,
    server: str,
    default_port: int,
    default_path: str,
    path_name: str = "path",
    options: Collection[str] = (),
) -> ServerURL:
    """Parse ``url`` of a ``server`` (its name in messages, e.g. ``"ZooKeeper"``).

    Hosts without a port get ``default_port``; an empty path (or ``/``) is
    ``default_path``; ``path_name`` names the path in messages (``"chroot"``); only the
    query keys in ``options`` are accepted, each a number.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != scheme:
        article = "an" if server[:1].lower() in "aeiou" else "a"
        raise ConfigError(f"not {article} {server} metadata URL: {url!r}")
    hosts = []
    for part in parts.netloc.split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep:
            host, port = part, str(default_port)
        if not host or not port.isdigit():
            raise ConfigError(f"metadata URL {url!r}: bad host {part!r}")
        hosts.append(f"{host}:{port}")
    if not hosts:
        raise ConfigError(f"metadata URL {url!r} names no {server} host")
    path = urllib.parse.unquote(parts.path).rstrip("/") or default_path
    try:
        validate_path(path)
    except InvalidArgument as exc:
        raise ConfigError(f"metadata URL {url!r}: bad {path_name}: {exc}") from None
    values: dict[str, float] = {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key not in options:
            raise ConfigError(f"metadata URL {url!r}: unknown option {key!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ConfigError(f"metadata URL {url!r}: {key} must be a number") from None
    return ServerURL(tuple(hosts), path, values, url)
