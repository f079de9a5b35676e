"""Fixtures of the secured admin API's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from secure_admin_support import SecureAdminStandalone

from pigeon.core.testing import SecurityFiles


@pytest.fixture(scope="module")
def secure_admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureAdminStandalone]:
    """A standalone with authentication, authorization and HTTPS on (one per module)."""
    root = tmp_path_factory.mktemp("secure-admin")
    server = SecureAdminStandalone(root / "data", SecurityFiles.create(root / "certs")).start()
    try:
        yield server
    finally:
        server.stop()
