"""parse_server_url: the URLs of the ZooKeeper and etcd backends."""

from __future__ import annotations

from functools import partial

import pytest

from pigeon.core.errors import ConfigError
from pigeon.core.metadata import ServerURL, parse_server_url

zk = partial(
    parse_server_url,
    scheme="zk",
    server="ZooKeeper",
    default_port=2181,
    default_path="/pigeon",
    path_name="chroot",
    options=("session_timeout", "request_timeout"),
)


@pytest.mark.parametrize(
    ("url", "hosts", "path"),
    [
        ("zk://127.0.0.1:2181/pigeon", ("127.0.0.1:2181",), "/pigeon"),
        ("zk://a:1, b:2,/x/y", ("a:1", "b:2"), "/x/y"),
        ("zk://zk1", ("zk1:2181",), "/pigeon"),
        ("zk://zk1:7/", ("zk1:7",), "/pigeon"),
        ("zk://[::1]:7/a%20b", ("[::1]:7",), "/a b"),
    ],
)
def test_hosts_and_path(url: str, hosts: tuple[str, ...], path: str) -> None:
    assert zk(url) == ServerURL(hosts, path, {})


def test_options_are_seconds() -> None:
    assert zk("zk://h/c?session_timeout=2.5&request_timeout=4").options == {
        "session_timeout": 2.5,
        "request_timeout": 4.0,
    }


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("etcd://h:1/x", "not a ZooKeeper metadata URL"),
        ("zk:///x", "names no ZooKeeper host"),
        ("zk://h:port/x", "bad host 'h:port'"),
        ("zk://:1/x", "bad host ':1'"),
        ("zk://h/a//b", "bad chroot"),
        ("zk://h/x?nope=1", "unknown option 'nope'"),
        ("zk://h/x?session_timeout=soon", "session_timeout must be a number"),
    ],
)
def test_errors_name_the_url(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        zk(url)
    assert repr(url) in str(error.value)


def test_the_server_is_named_with_its_article() -> None:
    with pytest.raises(ConfigError, match="not an etcd metadata URL"):
        parse_server_url("zk://h/", scheme="etcd", server="etcd", default_port=1, default_path="/p")
