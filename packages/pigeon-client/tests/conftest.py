"""Fixtures of the client's tests: a real ``pigeon standalone`` per test module, and for
the security tests the run's certificates and a fake broker over TLS (see
``_fake_broker``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from _fake_broker import Running, fake_broker, server_tls

from pigeon.core.testing import SecurityFiles
from pigeon.core.testing.servers import Standalone


@pytest.fixture(scope="module")
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a ``pigeon standalone`` process (no fsync) that the module's tests share."""
    base = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    with contextlib.closing(Standalone(base / "data", log_dir=base, fsync=None).start()) as s:
        yield s.url


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> SecurityFiles:
    """A CA, the broker's certificate for 127.0.0.1 and localhost, and what else a test
    issues (one set per module)."""
    return SecurityFiles.create(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_broker(certs: SecurityFiles) -> Iterator[Running]:
    """A fake broker on a TLS port (``certs``' certificate) with token authentication."""
    with fake_broker(tls=server_tls(certs), tokens=True) as running:
        yield running
