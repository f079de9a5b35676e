"""Test helpers that start real servers as child processes, on free loopback ports.

* :class:`ZooKeeperServer` / :func:`zookeeper_server` and :class:`EtcdServer` /
  :func:`etcd_server`: a metadata server in a temporary directory (``url()`` gives the
  metadata store URL that reaches it); a missing binary raises :class:`ServerError`
  naming the Debian package to install.
* :class:`MotoS3Server` / :func:`moto_s3_server`: an S3-compatible store (moto's server
  mode) for the ``s3`` offloader's tests; ``endpoint``, ``create_bucket``, ``env()``.
* :class:`Standalone`: one ``pigeon standalone`` process that can be killed (-9),
  terminated and restarted on the same data directory and ports.
* :class:`SecurityFiles`: a CA, the nodes' certificate, a token secret key and tokens
  made per run, and the security keys of a node's TOML table; :func:`write_toml` writes
  tables for ``--config`` (:class:`Standalone` takes them as ``config=``).
* :func:`headless_chromium`: a selenium driver of a real headless Chromium (dashboard
  tests; skipped without Debian's chromium and chromium-driver packages).
* :func:`free_port`, :func:`free_ports`, :func:`port_open`, :func:`clean_env`,
  :func:`pigeon_command` and :func:`server_command` for tests that start processes of
  their own.

Every wait is bounded and fails with the tail of the server's log; every server is
stopped by its PID, never by name::

    from pigeon.core.testing.servers import zookeeper_server

    with zookeeper_server(tmp_path / "zk") as zk:
        store = ZooKeeperMetadataStore.from_url(zk.url("/pigeon"))
"""

from __future__ import annotations

from pigeon.core.testing._browser import headless_chromium
from pigeon.core.testing._metadata_servers import (
    READY_TIMEOUT,
    STOP_TIMEOUT,
    EtcdServer,
    MotoS3Server,
    ServerError,
    ZooKeeperServer,
    etcd_server,
    moto_s3_server,
    zookeeper_server,
)
from pigeon.core.testing._process import HOST, free_port, free_ports, port_open
from pigeon.core.testing._security import (
    NODE_ROLE,
    SecurityFiles,
    merge_tables,
    toml_text,
    write_toml,
)
from pigeon.core.testing._standalone import (
    STANDALONE_READY_TIMEOUT,
    Standalone,
    StandaloneError,
    clean_env,
    pigeon_command,
    server_command,
)

__all__ = [
    "HOST",
    "NODE_ROLE",
    "READY_TIMEOUT",
    "STANDALONE_READY_TIMEOUT",
    "STOP_TIMEOUT",
    "EtcdServer",
    "MotoS3Server",
    "SecurityFiles",
    "ServerError",
    "Standalone",
    "StandaloneError",
    "ZooKeeperServer",
    "clean_env",
    "etcd_server",
    "free_port",
    "free_ports",
    "headless_chromium",
    "merge_tables",
    "moto_s3_server",
    "pigeon_command",
    "port_open",
    "server_command",
    "toml_text",
    "write_toml",
    "zookeeper_server",
]
